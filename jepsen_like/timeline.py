"""An HTML timeline of a history: one self-contained file (inline CSS and JS, no network).

One lane per client, named with its job unless that is the default one (quorum calls as bars: green ok, red fail, orange unknown; failed
heartbeats as ticks under them), one lane per node from the monitor (leader in blue, follower
grey, candidate yellow, unreachable hatched), and faults as shaded bands across every lane from
injection to the ``recover`` that ended them. Drag to zoom, double-click to reset, hover for
details. ``render`` is pure (history in, HTML text out).
"""

from __future__ import annotations

import html
import json
from typing import Any, Sequence

from lighthouse_cluster.core.jobs import DEFAULT_JOB

from .history import MONITOR, NEMESIS, Event, is_client, pair_operations
from .schedule import RESTORING


def _data(history: Sequence[Event], checks: Sequence[dict[str, Any]]) -> dict[str, Any]:
    ops = pair_operations(history)
    end = max((e["time_ns"] for e in history), default=1)
    lanes: dict[str, list[list[Any]]] = {}
    ticks: dict[str, list[list[Any]]] = {}
    for op in ops:
        if not is_client(op.process):
            continue
        e = op.complete
        t1 = op.end_ns if op.end_ns is not None else end
        lane = op.process if op.job == DEFAULT_JOB else f"{op.process} {op.job}"
        if op.f == "quorum":
            v = op.value if isinstance(op.value, dict) else {}
            label = (f"quorum {v.get('quorum_id')} {v.get('participants')}" if op.type == "ok"
                     else f"quorum {op.type}: {(e or {}).get('error') or 'no completion'}")
            lanes.setdefault(lane, []).append(
                [op.start_ns / 1e6, t1 / 1e6, op.type, f"{label} via {op.node}"])
        elif op.f == "heartbeat" and op.type != "ok":
            ticks.setdefault(lane, []).append([op.start_ns / 1e6, t1 / 1e6, op.type,
                                                     f"heartbeat {op.type} via {op.node}: {(e or {}).get('error')}"])
    roles: dict[str, list[list[Any]]] = {}
    last: dict[str, list[Any]] = {}
    for e in history:
        if e["process"] == MONITOR and e["f"] == "status":
            node = e.get("node") or "?"
            v = e.get("value") or {}
            state = v.get("role", "unknown") if v.get("reachable", True) else "unreachable"
            label = f"{node} {state} term {v.get('term', '-')} leader {v.get('leader') or '-'}"
            if node in last:
                last[node][1] = e["time_ns"] / 1e6
            seg = [e["time_ns"] / 1e6, end / 1e6, state, label]
            roles.setdefault(node, []).append(seg)
            last[node] = seg
    bands, marks = [], []
    nem = [op for op in ops if op.process == NEMESIS]
    open_faults: list[list[Any]] = []
    for op in nem:
        desc = f"{op.f} {json.dumps(op.invoke.get('value'))} -> {op.type}"
        marks.append([op.start_ns / 1e6, desc])
        if op.f == "wait":
            continue
        if op.f in RESTORING:
            if op.f in ("recover", "heal"):
                for b in open_faults:
                    b[1] = (op.end_ns or op.start_ns) / 1e6
                open_faults = []
            continue
        band = [op.start_ns / 1e6, end / 1e6, op.f, desc]
        bands.append(band)
        open_faults.append(band)
    return {"end_ms": end / 1e6, "lanes": lanes, "ticks": ticks, "roles": roles, "bands": bands, "marks": marks,
            "checks": list(checks)}


def render(history: Sequence[Event], checks: Sequence[dict[str, Any]] = (), title: str = "jepsen_like run") -> str:
    data = json.dumps(_data(history, checks), separators=(",", ":")).replace("</", "<\\/")
    return _TEMPLATE.replace("__TITLE__", html.escape(title)).replace("__DATA__", data)


_TEMPLATE = """<!doctype html>
<html><head><meta charset="utf-8"><title>__TITLE__</title>
<style>
body{font:13px system-ui,sans-serif;margin:12px;color:#222}
#wrap{position:relative}canvas{border:1px solid #ccc;display:block;cursor:crosshair}
#tip{position:absolute;pointer-events:none;background:#fffbe6;border:1px solid #caa;padding:3px 6px;display:none;
white-space:pre;font:12px monospace;z-index:2}
.pass{color:#176c2b;font-weight:bold}.fail{color:#b3261e;font-weight:bold}
table{border-collapse:collapse;margin:8px 0}td{padding:1px 8px;vertical-align:top}
.key span{display:inline-block;width:12px;height:10px;margin:0 3px 0 10px}
</style></head><body>
<h2>__TITLE__</h2>
<table id="checks"></table>
<div class="key">quorum <span style="background:#2e7d32"></span>ok<span style="background:#c62828"></span>fail
<span style="background:#ef8f00"></span>unknown &nbsp; node <span style="background:#1565c0"></span>leader
<span style="background:#bbb"></span>follower<span style="background:#f2c200"></span>candidate
<span style="background:#eee;border:1px solid #999"></span>unreachable &nbsp; fault <span style="background:rgba(220,40,40,.15)"></span>
&nbsp; drag to zoom, double-click to reset</div>
<div id="wrap"><canvas id="c"></canvas><div id="tip"></div></div>
<details><summary>nemesis actions</summary><pre id="marks"></pre></details>
<script>
const D=__DATA__;
const C={ok:"#2e7d32",fail:"#c62828",info:"#ef8f00",leader:"#1565c0",follower:"#bbb",candidate:"#f2c200",
unknown:"#888",unreachable:"#eee"};
const t=document.getElementById("checks");
for(const c of D.checks){const r=t.insertRow();r.insertCell().innerHTML='<span class="'+(c.valid?'pass">PASS':'fail">FAIL')+'</span>';
r.insertCell().textContent=c.name;r.insertCell().textContent=c.summary;}
document.getElementById("marks").textContent=D.marks.map(m=>(m[0]/1000).toFixed(3)+"s  "+m[1]).join("\\n");
const lanes=[];for(const n of Object.keys(D.roles).sort())lanes.push({name:n,kind:"role",items:D.roles[n]});
for(const p of Object.keys(D.lanes).sort((a,b)=>a.localeCompare(b,undefined,{numeric:true})))
lanes.push({name:p,kind:"ops",items:D.lanes[p],ticks:D.ticks[p]||[]});
const cv=document.getElementById("c"),ctx=cv.getContext("2d"),tip=document.getElementById("tip");
const LH=26,LEFT=60,TOP=20;let v0=0,v1=D.end_ms||1,drag=null;
function size(){cv.width=Math.max(600,window.innerWidth-40);cv.height=TOP+lanes.length*LH+10;}
function x(ms){return LEFT+(ms-v0)/(v1-v0)*(cv.width-LEFT-10);}
function draw(){ctx.clearRect(0,0,cv.width,cv.height);ctx.font="11px sans-serif";
const step=Math.pow(10,Math.floor(Math.log10((v1-v0)/8)));ctx.fillStyle="#999";
for(let s=Math.ceil(v0/step)*step;s<=v1;s+=step){ctx.fillRect(x(s),TOP-4,1,cv.height);ctx.fillText((s/1000).toFixed(step<1000?2:0)+"s",x(s)+2,12);}
for(const b of D.bands){ctx.fillStyle="rgba(220,40,40,.15)";ctx.fillRect(x(b[0]),TOP,Math.max(2,x(b[1])-x(b[0])),cv.height-TOP);
ctx.fillStyle="#b3261e";ctx.fillText(b[2],x(b[0])+2,TOP+9);}
lanes.forEach((l,i)=>{const y=TOP+i*LH;ctx.fillStyle="#222";ctx.fillText(l.name,4,y+15);
for(const it of l.items){if(it[1]<v0||it[0]>v1)continue;const a=x(it[0]),w=Math.max(1,x(it[1])-a);
ctx.fillStyle=C[it[2]]||"#888";if(l.kind==="role"){ctx.fillRect(a,y+6,w,12);if(it[2]==="unreachable"){ctx.strokeStyle="#999";ctx.strokeRect(a,y+6,w,12);}}
else ctx.fillRect(a,y+3,w,13);}
if(l.ticks)for(const it of l.ticks){if(it[1]<v0||it[0]>v1)continue;ctx.fillStyle=C[it[2]];ctx.fillRect(x(it[0]),y+18,Math.max(1,x(it[1])-x(it[0])),4);}});
if(drag){ctx.fillStyle="rgba(0,0,200,.1)";ctx.fillRect(Math.min(drag.a,drag.b),0,Math.abs(drag.b-drag.a),cv.height);}}
function ms(px){return v0+(px-LEFT)/(cv.width-LEFT-10)*(v1-v0);}
cv.onmousedown=e=>{drag={a:e.offsetX,b:e.offsetX};};
cv.onmouseup=e=>{if(drag&&Math.abs(drag.b-drag.a)>4){const a=ms(Math.min(drag.a,drag.b)),b=ms(Math.max(drag.a,drag.b));v0=a;v1=b;}drag=null;draw();};
cv.ondblclick=()=>{v0=0;v1=D.end_ms||1;draw();};
cv.onmousemove=e=>{if(drag){drag.b=e.offsetX;draw();return;}const i=Math.floor((e.offsetY-TOP)/LH),l=lanes[i],m=ms(e.offsetX);
let hit=null;if(l){for(const it of l.items.concat(l.ticks||[]))if(it[0]<=m&&m<=it[1]+(v1-v0)/500){hit=it;}}
if(!hit)for(const b of D.bands)if(b[0]<=m&&m<=b[1])hit=b;
if(hit){tip.style.display="block";tip.style.left=(e.offsetX+12)+"px";tip.style.top=(e.offsetY+12)+"px";
tip.textContent=(hit[0]/1000).toFixed(3)+"s - "+(hit[1]/1000).toFixed(3)+"s\\n"+hit[3];}else tip.style.display="none";};
window.onresize=()=>{size();draw();};size();draw();
</script></body></html>
"""
