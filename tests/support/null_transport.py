"""A checkpoint transport for tests where no replica group heals (``init_sync=False``, every group
at the same step): any transfer fails the test."""

from __future__ import annotations


class NullTransport:
    def metadata(self) -> str:
        return "null://"

    def send_checkpoint(self, *args: object, **kwargs: object) -> None:
        raise AssertionError("no checkpoint should be sent in this test")

    def recv_checkpoint(self, *args: object, **kwargs: object) -> None:
        raise AssertionError("no checkpoint should be received in this test")

    def disallow_checkpoint(self) -> None:
        pass

    def shutdown(self, wait: bool = True) -> None:
        pass
