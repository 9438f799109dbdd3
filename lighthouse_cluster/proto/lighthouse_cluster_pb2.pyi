from . import torchft_pb2 as _torchft_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNKNOWN: _ClassVar[Role]
    FOLLOWER: _ClassVar[Role]
    CANDIDATE: _ClassVar[Role]
    LEADER: _ClassVar[Role]
ROLE_UNKNOWN: Role
FOLLOWER: Role
CANDIDATE: Role
LEADER: Role

class NodeInfo(_message.Message):
    __slots__ = ("id", "client_address", "raft_address")
    ID_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    RAFT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    id: str
    client_address: str
    raft_address: str
    def __init__(self, id: _Optional[str] = ..., client_address: _Optional[str] = ..., raft_address: _Optional[str] = ...) -> None: ...

class PeerState(_message.Message):
    __slots__ = ("node", "connected")
    NODE_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    node: NodeInfo
    connected: bool
    def __init__(self, node: _Optional[_Union[NodeInfo, _Mapping]] = ..., connected: _Optional[bool] = ...) -> None: ...

class HeartbeatAge(_message.Message):
    __slots__ = ("replica_id", "age_ms")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    AGE_MS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    age_ms: int
    def __init__(self, replica_id: _Optional[str] = ..., age_ms: _Optional[int] = ...) -> None: ...

class PendingRequester(_message.Message):
    __slots__ = ("member", "waiting_ms")
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    WAITING_MS_FIELD_NUMBER: _ClassVar[int]
    member: _torchft_pb2.QuorumMember
    waiting_ms: int
    def __init__(self, member: _Optional[_Union[_torchft_pb2.QuorumMember, _Mapping]] = ..., waiting_ms: _Optional[int] = ...) -> None: ...

class QuorumSettings(_message.Message):
    __slots__ = ("min_replicas", "join_timeout_ms", "quorum_tick_ms", "heartbeat_timeout_ms", "quorum_lease_ms", "liveness_timeout_ms")
    MIN_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    JOIN_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    QUORUM_TICK_MS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    QUORUM_LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    LIVENESS_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    min_replicas: int
    join_timeout_ms: int
    quorum_tick_ms: int
    heartbeat_timeout_ms: int
    quorum_lease_ms: int
    liveness_timeout_ms: int
    def __init__(self, min_replicas: _Optional[int] = ..., join_timeout_ms: _Optional[int] = ..., quorum_tick_ms: _Optional[int] = ..., heartbeat_timeout_ms: _Optional[int] = ..., quorum_lease_ms: _Optional[int] = ..., liveness_timeout_ms: _Optional[int] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("node", "role", "term", "commit_index", "last_applied", "leader_id", "leader_client_address", "peers", "has_quorum", "quorum", "heartbeats", "pending", "quorum_reason", "serving", "uptime_ms", "version", "schema_version", "settings", "ready", "ready_reason", "members_version", "tls", "rounds_on_lease", "rounds_committed", "enabled_schema_version", "jobs", "unsafe_no_fsync")
    NODE_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    COMMIT_INDEX_FIELD_NUMBER: _ClassVar[int]
    LAST_APPLIED_FIELD_NUMBER: _ClassVar[int]
    LEADER_ID_FIELD_NUMBER: _ClassVar[int]
    LEADER_CLIENT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    HAS_QUORUM_FIELD_NUMBER: _ClassVar[int]
    QUORUM_FIELD_NUMBER: _ClassVar[int]
    HEARTBEATS_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    QUORUM_REASON_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    UPTIME_MS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    READY_REASON_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_VERSION_FIELD_NUMBER: _ClassVar[int]
    TLS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_ON_LEASE_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    ENABLED_SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    UNSAFE_NO_FSYNC_FIELD_NUMBER: _ClassVar[int]
    node: NodeInfo
    role: Role
    term: int
    commit_index: int
    last_applied: int
    leader_id: str
    leader_client_address: str
    peers: _containers.RepeatedCompositeFieldContainer[PeerState]
    has_quorum: bool
    quorum: _torchft_pb2.Quorum
    heartbeats: _containers.RepeatedCompositeFieldContainer[HeartbeatAge]
    pending: _containers.RepeatedCompositeFieldContainer[PendingRequester]
    quorum_reason: str
    serving: bool
    uptime_ms: int
    version: str
    schema_version: int
    settings: QuorumSettings
    ready: bool
    ready_reason: str
    members_version: int
    tls: bool
    rounds_on_lease: int
    rounds_committed: int
    enabled_schema_version: int
    jobs: _containers.RepeatedCompositeFieldContainer[Job]
    unsafe_no_fsync: bool
    def __init__(self, node: _Optional[_Union[NodeInfo, _Mapping]] = ..., role: _Optional[_Union[Role, str]] = ..., term: _Optional[int] = ..., commit_index: _Optional[int] = ..., last_applied: _Optional[int] = ..., leader_id: _Optional[str] = ..., leader_client_address: _Optional[str] = ..., peers: _Optional[_Iterable[_Union[PeerState, _Mapping]]] = ..., has_quorum: _Optional[bool] = ..., quorum: _Optional[_Union[_torchft_pb2.Quorum, _Mapping]] = ..., heartbeats: _Optional[_Iterable[_Union[HeartbeatAge, _Mapping]]] = ..., pending: _Optional[_Iterable[_Union[PendingRequester, _Mapping]]] = ..., quorum_reason: _Optional[str] = ..., serving: _Optional[bool] = ..., uptime_ms: _Optional[int] = ..., version: _Optional[str] = ..., schema_version: _Optional[int] = ..., settings: _Optional[_Union[QuorumSettings, _Mapping]] = ..., ready: _Optional[bool] = ..., ready_reason: _Optional[str] = ..., members_version: _Optional[int] = ..., tls: _Optional[bool] = ..., rounds_on_lease: _Optional[int] = ..., rounds_committed: _Optional[int] = ..., enabled_schema_version: _Optional[int] = ..., jobs: _Optional[_Iterable[_Union[Job, _Mapping]]] = ..., unsafe_no_fsync: _Optional[bool] = ...) -> None: ...

class LeaderRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LeaderResponse(_message.Message):
    __slots__ = ("leader_id", "leader_client_address", "term", "nodes")
    LEADER_ID_FIELD_NUMBER: _ClassVar[int]
    LEADER_CLIENT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    leader_id: str
    leader_client_address: str
    term: int
    nodes: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    def __init__(self, leader_id: _Optional[str] = ..., leader_client_address: _Optional[str] = ..., term: _Optional[int] = ..., nodes: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ...) -> None: ...

class HeartbeatBatch(_message.Message):
    __slots__ = ("from_node", "replica_ids", "job")
    FROM_NODE_FIELD_NUMBER: _ClassVar[int]
    REPLICA_IDS_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    from_node: str
    replica_ids: _containers.RepeatedScalarFieldContainer[str]
    job: str
    def __init__(self, from_node: _Optional[str] = ..., replica_ids: _Optional[_Iterable[str]] = ..., job: _Optional[str] = ...) -> None: ...

class HeartbeatBatchResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("replica_id", "keepalive_interval_ms")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    KEEPALIVE_INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    keepalive_interval_ms: int
    def __init__(self, replica_id: _Optional[str] = ..., keepalive_interval_ms: _Optional[int] = ...) -> None: ...

class PeerDied(_message.Message):
    __slots__ = ("quorum_id", "replica_ids", "reason")
    QUORUM_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_IDS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    quorum_id: int
    replica_ids: _containers.RepeatedScalarFieldContainer[str]
    reason: str
    def __init__(self, quorum_id: _Optional[int] = ..., replica_ids: _Optional[_Iterable[str]] = ..., reason: _Optional[str] = ...) -> None: ...

class WatchEvent(_message.Message):
    __slots__ = ("accepted", "peer_died")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    PEER_DIED_FIELD_NUMBER: _ClassVar[int]
    accepted: WatchAccepted
    peer_died: PeerDied
    def __init__(self, accepted: _Optional[_Union[WatchAccepted, _Mapping]] = ..., peer_died: _Optional[_Union[PeerDied, _Mapping]] = ...) -> None: ...

class WatchAccepted(_message.Message):
    __slots__ = ("leader_id", "term", "liveness_timeout_ms")
    LEADER_ID_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    LIVENESS_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    leader_id: str
    term: int
    liveness_timeout_ms: int
    def __init__(self, leader_id: _Optional[str] = ..., term: _Optional[int] = ..., liveness_timeout_ms: _Optional[int] = ...) -> None: ...

class JobSettings(_message.Message):
    __slots__ = ("min_replicas", "join_timeout_ms", "quorum_tick_ms", "heartbeat_timeout_ms", "quorum_lease_ms", "max_replicas", "max_member_bytes")
    MIN_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    JOIN_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    QUORUM_TICK_MS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    QUORUM_LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    MAX_MEMBER_BYTES_FIELD_NUMBER: _ClassVar[int]
    min_replicas: int
    join_timeout_ms: int
    quorum_tick_ms: int
    heartbeat_timeout_ms: int
    quorum_lease_ms: int
    max_replicas: int
    max_member_bytes: int
    def __init__(self, min_replicas: _Optional[int] = ..., join_timeout_ms: _Optional[int] = ..., quorum_tick_ms: _Optional[int] = ..., heartbeat_timeout_ms: _Optional[int] = ..., quorum_lease_ms: _Optional[int] = ..., max_replicas: _Optional[int] = ..., max_member_bytes: _Optional[int] = ...) -> None: ...

class JobSettingsUpdate(_message.Message):
    __slots__ = ("min_replicas", "join_timeout_ms", "quorum_tick_ms", "heartbeat_timeout_ms", "quorum_lease_ms", "max_replicas", "max_member_bytes")
    MIN_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    JOIN_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    QUORUM_TICK_MS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    QUORUM_LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    MAX_MEMBER_BYTES_FIELD_NUMBER: _ClassVar[int]
    min_replicas: int
    join_timeout_ms: int
    quorum_tick_ms: int
    heartbeat_timeout_ms: int
    quorum_lease_ms: int
    max_replicas: int
    max_member_bytes: int
    def __init__(self, min_replicas: _Optional[int] = ..., join_timeout_ms: _Optional[int] = ..., quorum_tick_ms: _Optional[int] = ..., heartbeat_timeout_ms: _Optional[int] = ..., quorum_lease_ms: _Optional[int] = ..., max_replicas: _Optional[int] = ..., max_member_bytes: _Optional[int] = ...) -> None: ...

class JobPort(_message.Message):
    __slots__ = ("node_id", "port")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    port: int
    def __init__(self, node_id: _Optional[str] = ..., port: _Optional[int] = ...) -> None: ...

class ConfigEntry(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: str
    def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("name", "settings", "settings_from_flags", "ports", "config", "version", "quorum_id", "has_quorum", "quorum", "listening_port", "port_error", "leader_view", "heartbeats", "pending", "quorum_reason", "rounds_on_lease", "rounds_committed", "open_streams", "heartbeating_replicas")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FROM_FLAGS_FIELD_NUMBER: _ClassVar[int]
    PORTS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    QUORUM_ID_FIELD_NUMBER: _ClassVar[int]
    HAS_QUORUM_FIELD_NUMBER: _ClassVar[int]
    QUORUM_FIELD_NUMBER: _ClassVar[int]
    LISTENING_PORT_FIELD_NUMBER: _ClassVar[int]
    PORT_ERROR_FIELD_NUMBER: _ClassVar[int]
    LEADER_VIEW_FIELD_NUMBER: _ClassVar[int]
    HEARTBEATS_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    QUORUM_REASON_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_ON_LEASE_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    OPEN_STREAMS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEATING_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    name: str
    settings: JobSettings
    settings_from_flags: bool
    ports: _containers.RepeatedCompositeFieldContainer[JobPort]
    config: _containers.RepeatedCompositeFieldContainer[ConfigEntry]
    version: int
    quorum_id: int
    has_quorum: bool
    quorum: _torchft_pb2.Quorum
    listening_port: int
    port_error: str
    leader_view: bool
    heartbeats: _containers.RepeatedCompositeFieldContainer[HeartbeatAge]
    pending: _containers.RepeatedCompositeFieldContainer[PendingRequester]
    quorum_reason: str
    rounds_on_lease: int
    rounds_committed: int
    open_streams: int
    heartbeating_replicas: int
    def __init__(self, name: _Optional[str] = ..., settings: _Optional[_Union[JobSettings, _Mapping]] = ..., settings_from_flags: _Optional[bool] = ..., ports: _Optional[_Iterable[_Union[JobPort, _Mapping]]] = ..., config: _Optional[_Iterable[_Union[ConfigEntry, _Mapping]]] = ..., version: _Optional[int] = ..., quorum_id: _Optional[int] = ..., has_quorum: _Optional[bool] = ..., quorum: _Optional[_Union[_torchft_pb2.Quorum, _Mapping]] = ..., listening_port: _Optional[int] = ..., port_error: _Optional[str] = ..., leader_view: _Optional[bool] = ..., heartbeats: _Optional[_Iterable[_Union[HeartbeatAge, _Mapping]]] = ..., pending: _Optional[_Iterable[_Union[PendingRequester, _Mapping]]] = ..., quorum_reason: _Optional[str] = ..., rounds_on_lease: _Optional[int] = ..., rounds_committed: _Optional[int] = ..., open_streams: _Optional[int] = ..., heartbeating_replicas: _Optional[int] = ...) -> None: ...

class JobRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs", "answered_by", "leader_view")
    JOBS_FIELD_NUMBER: _ClassVar[int]
    ANSWERED_BY_FIELD_NUMBER: _ClassVar[int]
    LEADER_VIEW_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[Job]
    answered_by: str
    leader_view: bool
    def __init__(self, jobs: _Optional[_Iterable[_Union[Job, _Mapping]]] = ..., answered_by: _Optional[str] = ..., leader_view: _Optional[bool] = ...) -> None: ...

class AddJobRequest(_message.Message):
    __slots__ = ("name", "settings", "ports", "config")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    PORTS_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    name: str
    settings: JobSettingsUpdate
    ports: _containers.RepeatedCompositeFieldContainer[JobPort]
    config: _containers.RepeatedCompositeFieldContainer[ConfigEntry]
    def __init__(self, name: _Optional[str] = ..., settings: _Optional[_Union[JobSettingsUpdate, _Mapping]] = ..., ports: _Optional[_Iterable[_Union[JobPort, _Mapping]]] = ..., config: _Optional[_Iterable[_Union[ConfigEntry, _Mapping]]] = ...) -> None: ...

class SetJobRequest(_message.Message):
    __slots__ = ("name", "settings", "set_ports", "ports", "set_config", "unset_config")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    SET_PORTS_FIELD_NUMBER: _ClassVar[int]
    PORTS_FIELD_NUMBER: _ClassVar[int]
    SET_CONFIG_FIELD_NUMBER: _ClassVar[int]
    UNSET_CONFIG_FIELD_NUMBER: _ClassVar[int]
    name: str
    settings: JobSettingsUpdate
    set_ports: bool
    ports: _containers.RepeatedCompositeFieldContainer[JobPort]
    set_config: _containers.RepeatedCompositeFieldContainer[ConfigEntry]
    unset_config: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., settings: _Optional[_Union[JobSettingsUpdate, _Mapping]] = ..., set_ports: _Optional[bool] = ..., ports: _Optional[_Iterable[_Union[JobPort, _Mapping]]] = ..., set_config: _Optional[_Iterable[_Union[ConfigEntry, _Mapping]]] = ..., unset_config: _Optional[_Iterable[str]] = ...) -> None: ...

class RemoveJobRequest(_message.Message):
    __slots__ = ("name", "force")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FORCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    force: bool
    def __init__(self, name: _Optional[str] = ..., force: _Optional[bool] = ...) -> None: ...

class RemoveJobResponse(_message.Message):
    __slots__ = ("name", "last_quorum_id")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LAST_QUORUM_ID_FIELD_NUMBER: _ClassVar[int]
    name: str
    last_quorum_id: int
    def __init__(self, name: _Optional[str] = ..., last_quorum_id: _Optional[int] = ...) -> None: ...

class MembersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MembersResponse(_message.Message):
    __slots__ = ("members", "leader_id", "term", "version", "connected")
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    LEADER_ID_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    members: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    leader_id: str
    term: int
    version: int
    connected: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, members: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ..., leader_id: _Optional[str] = ..., term: _Optional[int] = ..., version: _Optional[int] = ..., connected: _Optional[_Iterable[str]] = ...) -> None: ...

class AddMemberRequest(_message.Message):
    __slots__ = ("node",)
    NODE_FIELD_NUMBER: _ClassVar[int]
    node: NodeInfo
    def __init__(self, node: _Optional[_Union[NodeInfo, _Mapping]] = ...) -> None: ...

class RemoveMemberRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class TransferLeaderRequest(_message.Message):
    __slots__ = ("to_node_id",)
    TO_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    to_node_id: str
    def __init__(self, to_node_id: _Optional[str] = ...) -> None: ...

class TransferLeaderResponse(_message.Message):
    __slots__ = ("previous_leader_id", "leader_id", "term")
    PREVIOUS_LEADER_ID_FIELD_NUMBER: _ClassVar[int]
    LEADER_ID_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    previous_leader_id: str
    leader_id: str
    term: int
    def __init__(self, previous_leader_id: _Optional[str] = ..., leader_id: _Optional[str] = ..., term: _Optional[int] = ...) -> None: ...

class SnapshotRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Snapshot(_message.Message):
    __slots__ = ("state", "term", "last_applied", "quorum_id", "leader_id", "taken_ms", "schema_version")
    STATE_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    LAST_APPLIED_FIELD_NUMBER: _ClassVar[int]
    QUORUM_ID_FIELD_NUMBER: _ClassVar[int]
    LEADER_ID_FIELD_NUMBER: _ClassVar[int]
    TAKEN_MS_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_VERSION_FIELD_NUMBER: _ClassVar[int]
    state: bytes
    term: int
    last_applied: int
    quorum_id: int
    leader_id: str
    taken_ms: int
    schema_version: int
    def __init__(self, state: _Optional[bytes] = ..., term: _Optional[int] = ..., last_applied: _Optional[int] = ..., quorum_id: _Optional[int] = ..., leader_id: _Optional[str] = ..., taken_ms: _Optional[int] = ..., schema_version: _Optional[int] = ...) -> None: ...

class RestoreResponse(_message.Message):
    __slots__ = ("applied", "quorum_id", "previous_quorum_id", "jobs")
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    QUORUM_ID_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_QUORUM_ID_FIELD_NUMBER: _ClassVar[int]
    JOBS_FIELD_NUMBER: _ClassVar[int]
    applied: bool
    quorum_id: int
    previous_quorum_id: int
    jobs: _containers.RepeatedCompositeFieldContainer[RestoredJob]
    def __init__(self, applied: _Optional[bool] = ..., quorum_id: _Optional[int] = ..., previous_quorum_id: _Optional[int] = ..., jobs: _Optional[_Iterable[_Union[RestoredJob, _Mapping]]] = ...) -> None: ...

class RestoredJob(_message.Message):
    __slots__ = ("name", "created", "quorum_id", "previous_quorum_id", "not_restored")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CREATED_FIELD_NUMBER: _ClassVar[int]
    QUORUM_ID_FIELD_NUMBER: _ClassVar[int]
    PREVIOUS_QUORUM_ID_FIELD_NUMBER: _ClassVar[int]
    NOT_RESTORED_FIELD_NUMBER: _ClassVar[int]
    name: str
    created: bool
    quorum_id: int
    previous_quorum_id: int
    not_restored: str
    def __init__(self, name: _Optional[str] = ..., created: _Optional[bool] = ..., quorum_id: _Optional[int] = ..., previous_quorum_id: _Optional[int] = ..., not_restored: _Optional[str] = ...) -> None: ...

class ForwardedQuorum(_message.Message):
    __slots__ = ("key", "request", "has_deadline", "timeout_ms", "job")
    KEY_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    HAS_DEADLINE_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    key: int
    request: bytes
    has_deadline: bool
    timeout_ms: int
    job: str
    def __init__(self, key: _Optional[int] = ..., request: _Optional[bytes] = ..., has_deadline: _Optional[bool] = ..., timeout_ms: _Optional[int] = ..., job: _Optional[str] = ...) -> None: ...

class QuorumForwardUp(_message.Message):
    __slots__ = ("from_node", "add", "withdraw")
    FROM_NODE_FIELD_NUMBER: _ClassVar[int]
    ADD_FIELD_NUMBER: _ClassVar[int]
    WITHDRAW_FIELD_NUMBER: _ClassVar[int]
    from_node: str
    add: _containers.RepeatedCompositeFieldContainer[ForwardedQuorum]
    withdraw: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, from_node: _Optional[str] = ..., add: _Optional[_Iterable[_Union[ForwardedQuorum, _Mapping]]] = ..., withdraw: _Optional[_Iterable[int]] = ...) -> None: ...

class ForwardedQuorumError(_message.Message):
    __slots__ = ("key", "code", "details")
    KEY_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    key: int
    code: int
    details: str
    def __init__(self, key: _Optional[int] = ..., code: _Optional[int] = ..., details: _Optional[str] = ...) -> None: ...

class QuorumForwardDown(_message.Message):
    __slots__ = ("response", "keys", "errors")
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    response: bytes
    keys: _containers.RepeatedScalarFieldContainer[int]
    errors: _containers.RepeatedCompositeFieldContainer[ForwardedQuorumError]
    def __init__(self, response: _Optional[bytes] = ..., keys: _Optional[_Iterable[int]] = ..., errors: _Optional[_Iterable[_Union[ForwardedQuorumError, _Mapping]]] = ...) -> None: ...

class KVNamespace(_message.Message):
    __slots__ = ("job", "run_id")
    JOB_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    job: str
    run_id: str
    def __init__(self, job: _Optional[str] = ..., run_id: _Optional[str] = ...) -> None: ...

class KVEntry(_message.Message):
    __slots__ = ("key", "value", "version")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: bytes
    version: int
    def __init__(self, key: _Optional[str] = ..., value: _Optional[bytes] = ..., version: _Optional[int] = ...) -> None: ...

class KVGetRequest(_message.Message):
    __slots__ = ("ns", "key")
    NS_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    ns: KVNamespace
    key: str
    def __init__(self, ns: _Optional[_Union[KVNamespace, _Mapping]] = ..., key: _Optional[str] = ...) -> None: ...

class KVGetResponse(_message.Message):
    __slots__ = ("found", "entry")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    found: bool
    entry: KVEntry
    def __init__(self, found: _Optional[bool] = ..., entry: _Optional[_Union[KVEntry, _Mapping]] = ...) -> None: ...

class KVSetRequest(_message.Message):
    __slots__ = ("ns", "key", "value", "request_id")
    NS_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ns: KVNamespace
    key: str
    value: bytes
    request_id: str
    def __init__(self, ns: _Optional[_Union[KVNamespace, _Mapping]] = ..., key: _Optional[str] = ..., value: _Optional[bytes] = ..., request_id: _Optional[str] = ...) -> None: ...

class KVCompareAndSetRequest(_message.Message):
    __slots__ = ("ns", "key", "value", "expected_version", "expected_value", "request_id")
    NS_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_VALUE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ns: KVNamespace
    key: str
    value: bytes
    expected_version: int
    expected_value: bytes
    request_id: str
    def __init__(self, ns: _Optional[_Union[KVNamespace, _Mapping]] = ..., key: _Optional[str] = ..., value: _Optional[bytes] = ..., expected_version: _Optional[int] = ..., expected_value: _Optional[bytes] = ..., request_id: _Optional[str] = ...) -> None: ...

class KVAddRequest(_message.Message):
    __slots__ = ("ns", "key", "delta", "request_id")
    NS_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ns: KVNamespace
    key: str
    delta: int
    request_id: str
    def __init__(self, ns: _Optional[_Union[KVNamespace, _Mapping]] = ..., key: _Optional[str] = ..., delta: _Optional[int] = ..., request_id: _Optional[str] = ...) -> None: ...

class KVDeleteRequest(_message.Message):
    __slots__ = ("ns", "key", "expected_version", "request_id")
    NS_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_VERSION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ns: KVNamespace
    key: str
    expected_version: int
    request_id: str
    def __init__(self, ns: _Optional[_Union[KVNamespace, _Mapping]] = ..., key: _Optional[str] = ..., expected_version: _Optional[int] = ..., request_id: _Optional[str] = ...) -> None: ...

class KVWriteResponse(_message.Message):
    __slots__ = ("applied", "found", "entry", "counter", "duplicate")
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    ENTRY_FIELD_NUMBER: _ClassVar[int]
    COUNTER_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    applied: bool
    found: bool
    entry: KVEntry
    counter: int
    duplicate: bool
    def __init__(self, applied: _Optional[bool] = ..., found: _Optional[bool] = ..., entry: _Optional[_Union[KVEntry, _Mapping]] = ..., counter: _Optional[int] = ..., duplicate: _Optional[bool] = ...) -> None: ...

class KVListRequest(_message.Message):
    __slots__ = ("ns", "prefix", "limit", "values")
    NS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    ns: KVNamespace
    prefix: str
    limit: int
    values: bool
    def __init__(self, ns: _Optional[_Union[KVNamespace, _Mapping]] = ..., prefix: _Optional[str] = ..., limit: _Optional[int] = ..., values: _Optional[bool] = ...) -> None: ...

class KVListResponse(_message.Message):
    __slots__ = ("entries", "total")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[KVEntry]
    total: int
    def __init__(self, entries: _Optional[_Iterable[_Union[KVEntry, _Mapping]]] = ..., total: _Optional[int] = ...) -> None: ...

class KVWaitRequest(_message.Message):
    __slots__ = ("ns", "keys", "known_versions", "timeout_ms")
    NS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    KNOWN_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    ns: KVNamespace
    keys: _containers.RepeatedScalarFieldContainer[str]
    known_versions: _containers.RepeatedScalarFieldContainer[int]
    timeout_ms: int
    def __init__(self, ns: _Optional[_Union[KVNamespace, _Mapping]] = ..., keys: _Optional[_Iterable[str]] = ..., known_versions: _Optional[_Iterable[int]] = ..., timeout_ms: _Optional[int] = ...) -> None: ...

class KVWaitResponse(_message.Message):
    __slots__ = ("ready", "entries", "answered_by")
    READY_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    ANSWERED_BY_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    entries: _containers.RepeatedCompositeFieldContainer[KVEntry]
    answered_by: str
    def __init__(self, ready: _Optional[bool] = ..., entries: _Optional[_Iterable[_Union[KVEntry, _Mapping]]] = ..., answered_by: _Optional[str] = ...) -> None: ...

class KVDropRequest(_message.Message):
    __slots__ = ("ns",)
    NS_FIELD_NUMBER: _ClassVar[int]
    ns: KVNamespace
    def __init__(self, ns: _Optional[_Union[KVNamespace, _Mapping]] = ...) -> None: ...

class KVDropResponse(_message.Message):
    __slots__ = ("dropped", "keys")
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    dropped: bool
    keys: int
    def __init__(self, dropped: _Optional[bool] = ..., keys: _Optional[int] = ...) -> None: ...

class KVListNamespacesRequest(_message.Message):
    __slots__ = ("job",)
    JOB_FIELD_NUMBER: _ClassVar[int]
    job: str
    def __init__(self, job: _Optional[str] = ...) -> None: ...

class KVNamespaceInfo(_message.Message):
    __slots__ = ("ns", "keys", "bytes", "created_ms", "touched_ms", "rendezvous", "round", "participants", "waiting")
    NS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CREATED_MS_FIELD_NUMBER: _ClassVar[int]
    TOUCHED_MS_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    ns: KVNamespace
    keys: int
    bytes: int
    created_ms: int
    touched_ms: int
    rendezvous: str
    round: int
    participants: int
    waiting: int
    def __init__(self, ns: _Optional[_Union[KVNamespace, _Mapping]] = ..., keys: _Optional[int] = ..., bytes: _Optional[int] = ..., created_ms: _Optional[int] = ..., touched_ms: _Optional[int] = ..., rendezvous: _Optional[str] = ..., round: _Optional[int] = ..., participants: _Optional[int] = ..., waiting: _Optional[int] = ...) -> None: ...

class KVListNamespacesResponse(_message.Message):
    __slots__ = ("namespaces", "idle_expiry_ms")
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    IDLE_EXPIRY_MS_FIELD_NUMBER: _ClassVar[int]
    namespaces: _containers.RepeatedCompositeFieldContainer[KVNamespaceInfo]
    idle_expiry_ms: int
    def __init__(self, namespaces: _Optional[_Iterable[_Union[KVNamespaceInfo, _Mapping]]] = ..., idle_expiry_ms: _Optional[int] = ...) -> None: ...
