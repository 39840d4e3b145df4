"""Conformance with SGLang 0.5.23, checked against SGLang's own source, not a copy of its API.

The test downloads the sglang==0.5.23 wheel once (`pip download --no-deps` into .cache/wheels;
skipped, saying why, only when pip cannot reach an index) and reads its definitions with `ast`
(importing them would need its GPU dependencies): the fields of the request structs
(srt/managers/io_struct.py, srt/sampling/sampling_params.py), the routes of
srt/entrypoints/http_server.py and v1_loads.py with the struct each handler takes, the meta_info
keys srt/managers/tokenizer_manager.py and srt/utils/weight_versions.py write, the keys of
/model_info, /server_info (ServerArgs' fields) and /v1/loads. Then:
  - our client (EngineClient, SGLangBackend), every method, against a recording HTTP server:
    each route it calls exists with that method, each field it sends is a field of the struct
    that route takes (sampling_params: of SGLang's SamplingParams);
  - parse_output over a recording dict: each meta_info key it reads is one SGLang writes;
  - our embedded server: its routes are SGLang's (but /get_load, sglang-router's), and the keys of
    its /generate, /model_info, /server_info and /v1/loads answers are keys SGLang writes there;
  - the weight-update group: SGLang's own `init_custom_process_group` (srt/utils/common.py, run
    from the wheel's source in a child process) joins as rank 1 the group our pusher forms as rank
    0 (`WeightGroup.join(sglang=True)`), and receives its broadcasts.
What was checked is printed (`pytest -s`) and written to .cache/sglang_conformance.json.

    pytest tests/e2e/test_sglang_conformance.py -s
"""

from __future__ import annotations

import ast
import asyncio
import base64
import inspect
import json
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp import web

from miles_async.actors.external import bucket_requests
from miles_async.engine.backend import GenerateParams, SGLangBackend
from miles_async.engine.client import EngineClient, parse_output
from miles_async.engine.core import Engine, EngineConfig
from miles_async.engine.server import EngineServer, create_app
from miles_async.transport.broadcast import layout_of, layout_to_json
from miles_async.transport.groups import WeightGroup

SGLANG = "sglang==0.5.23"
ROOT = Path(__file__).resolve().parents[2]
WHEELS = ROOT / ".cache" / "wheels"
RECORD = ROOT / ".cache" / "sglang_conformance.json"
TIMEOUT_S = 60
# Routes our server has that SGLang 0.5.23 does not, and why.
OURS_ONLY = {"/get_load": "sglang-router 0.3.2 polls it (SGLang before /v1/loads had it)",
             "/v1/models/{model}": "SGLang's /v1/models/{model:path}, in aiohttp's spelling",
             "/metrics": "SGLang mounts prometheus_client's app there (add_prometheus_middleware), not a route"}


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S))


# ----- SGLang's definitions, read from its wheel -----

@dataclass
class SGLangAPI:
    structs: dict[str, set[str]]  # request/response struct -> its fields (inherited ones included)
    annotations: dict[str, dict[str, str]]  # struct -> field -> its annotation's source text
    routes: dict[str, tuple[set[str], str | None]]  # path -> (methods, the struct its handler takes)
    meta_info_keys: set[str]
    output_keys: set[str]  # of a /generate item: text, output_ids, meta_info, ...
    model_info_keys: set[str]
    server_info_keys: set[str]
    loads_keys: set[str]  # /v1/loads' top level
    load_keys: set[str]  # of each entry of its "loads"
    checked: dict[str, Any] = field(default_factory=dict)  # what the tests compared, for the record

    def record(self, section: str, value: Any) -> None:
        self.checked[section] = value


def _wheel() -> Path:
    found = sorted(WHEELS.glob("sglang-0.5.23-*.whl"))
    if not found:
        WHEELS.mkdir(parents=True, exist_ok=True)
        try:
            proc = subprocess.run([sys.executable, "-m", "pip", "download", SGLANG, "--no-deps", "-q", "-d",
                                   str(WHEELS)], check=False, capture_output=True, text=True, timeout=900)
            reason = proc.stderr.strip()[-400:]
        except subprocess.TimeoutExpired:
            reason = "pip download timed out"
        found = sorted(WHEELS.glob("sglang-0.5.23-*.whl"))
        if not found:
            pytest.skip(f"pip could not download {SGLANG} (no package index reachable?): {reason}")
    return found[0]


def _classes(tree: ast.Module) -> dict[str, tuple[set[str], dict[str, str]]]:
    nodes = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}

    def fields(name: str) -> tuple[set[str], dict[str, str]]:
        node = nodes[name]
        names: set[str] = set()
        kinds: dict[str, str] = {}
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id in nodes:
                inherited, inherited_kinds = fields(base.id)
                names |= inherited
                kinds.update(inherited_kinds)
        for stmt in node.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                names.add(stmt.target.id)
                kinds[stmt.target.id] = ast.unparse(stmt.annotation)
        return names, kinds

    return {name: fields(name) for name in nodes}


def _str_keys(node: ast.AST) -> set[str]:
    """The constant string keys of every dict literal under `node`."""
    return {k.value for d in ast.walk(node) if isinstance(d, ast.Dict)
            for k in d.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}


def _stored_keys(node: ast.AST, name: str) -> set[str]:
    """Keys of `name[...] = ...`, `name = {...}` and `name.update({...})` under `node`."""
    keys: set[str] = set()
    for n in ast.walk(node):
        if (isinstance(n, ast.Subscript) and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name)
                and n.value.id == name and isinstance(n.slice, ast.Constant)):
            keys.add(n.slice.value)
        elif isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in n.targets):
            if isinstance(n.value, ast.Dict):
                keys |= {k.value for k in n.value.keys if isinstance(k, ast.Constant)}
        elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "update"
              and isinstance(n.func.value, ast.Name) and n.func.value.id == name and n.args
              and isinstance(n.args[0], ast.Dict)):
            keys |= {k.value for k in n.args[0].keys if isinstance(k, ast.Constant)}
    return keys


def _function(tree: ast.Module, name: str) -> ast.AST:
    return next(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name)


def _routes(tree: ast.Module, structs: dict[str, set[str]]) -> dict[str, tuple[set[str], str | None]]:
    routes: dict[str, tuple[set[str], str | None]] = {}
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for dec in fn.decorator_list:
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)
                    and isinstance(dec.func.value, ast.Name) and dec.func.value.id in ("app", "router")):
                continue
            verb = dec.func.attr
            if verb not in ("get", "post", "put", "delete", "api_route") or not dec.args:
                continue
            if not (isinstance(dec.args[0], ast.Constant) and isinstance(dec.args[0].value, str)):
                continue  # a path from the environment (Ollama's, Vertex's)
            methods = {verb.upper()} if verb != "api_route" else {
                m.value for kw in dec.keywords if kw.arg == "methods" for m in ast.walk(kw.value)
                if isinstance(m, ast.Constant)}
            struct = None
            for arg in fn.args.args:  # `obj: X` or `obj: Annotated[X, Body()]`
                names = {n.id for n in ast.walk(arg.annotation) if isinstance(n, ast.Name)} & structs.keys() \
                    if arg.annotation else set()
                struct = struct or next(iter(names), None)
            path = dec.args[0].value
            old_methods, old_struct = routes.get(path, (set(), None))
            routes[path] = (old_methods | methods, old_struct or struct)
    return routes


def read_sglang(wheel: Path) -> SGLangAPI:
    with zipfile.ZipFile(wheel) as z:
        def parse(path: str) -> ast.Module:
            return ast.parse(z.read(f"sglang/srt/{path}").decode())

        io_struct, sampling = parse("managers/io_struct.py"), parse("sampling/sampling_params.py")
        loads_module, snapshot = parse("entrypoints/v1_loads.py"), parse("managers/load_snapshot.py")
        http, tokenizer_manager = parse("entrypoints/http_server.py"), parse("managers/tokenizer_manager.py")
        versions, common = parse("utils/weight_versions.py"), parse("utils/common.py")
        field_order = parse("arg_groups/field_order.py")
        arg_fields = [ast.parse(z.read(name).decode()) for name in z.namelist()
                      if name.startswith("sglang/srt/arg_groups/fields/") and name.endswith(".py")]
    classes = {**_classes(io_struct), **_classes(snapshot), **_classes(versions)}
    classes["SamplingParams"] = _classes(sampling)["SamplingParams"]
    structs = {name: names for name, (names, _) in classes.items()}
    server_args = {c.value for c in ast.walk(_assigned(field_order, "POSITIONAL_FIELD_ORDER"))
                   if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    for tree in arg_fields:
        for names, _ in _classes(tree).values():
            server_args |= names
    output_keys = {k for d in ast.walk(tokenizer_manager) if isinstance(d, ast.Dict)
                   if "meta_info" in (keys := _str_keys(d)) for k in keys if k != "meta_info"} | {"meta_info"}
    load_snapshot = structs["LoadSnapshot"]
    return SGLangAPI(
        structs=structs, annotations={name: kinds for name, (_, kinds) in classes.items()},
        routes={**_routes(http, structs), **_routes(loads_module, structs)},
        meta_info_keys=_stored_keys(tokenizer_manager, "meta_info") | _stored_keys(versions, "meta_info"),
        output_keys=output_keys,
        model_info_keys=_stored_keys(_function(http, "model_info"), "result"),
        server_info_keys=server_args | _str_keys(_function(http, "server_info"))
        | _stored_keys(_function(common, "build_server_info"), "result"),
        loads_keys=_str_keys(_function(loads_module, "get_loads")),
        load_keys=load_snapshot - {"memory", "speculative", "lora", "disaggregation", "queues"})


def _assigned(tree: ast.Module, name: str) -> ast.AST:
    return next(n.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == name for t in n.targets))


@pytest.fixture(scope="module")
def sglang() -> Any:
    api = read_sglang(_wheel())
    yield api
    RECORD.parent.mkdir(parents=True, exist_ok=True)
    RECORD.write_text(json.dumps(api.checked, indent=1, sort_keys=True) + "\n")
    print(f"\nSGLang 0.5.23 conformance, what was checked (also in {RECORD}):")
    for section, value in sorted(api.checked.items()):
        print(f"  {section}: {json.dumps(value, sort_keys=True)}")


def test_the_reader_finds_sglangs_definitions(sglang):
    """Guards the ast reading: a change in SGLang's layout must fail here, not pass vacuously."""
    assert {"text", "input_ids", "sampling_params", "return_logprob", "rid"} <= sglang.structs["GenerateReqInput"]
    assert {"rid", "abort_all"} <= sglang.structs["AbortReq"]
    assert sglang.routes["/generate"] == ({"POST", "PUT"}, "GenerateReqInput")
    assert sglang.routes["/abort_request"] == ({"POST"}, "AbortReq")
    assert {"weight_versions", "weight_version", "output_token_logprobs", "finish_reason"} <= sglang.meta_info_keys
    assert {"model_path", "dp_size", "internal_states"} <= sglang.server_info_keys
    assert "/v1/loads" in sglang.routes and "num_running_reqs" in sglang.load_keys
    assert sglang.annotations["WeightVersionSpan"]["version"] == "str"


# ----- our client, recorded -----

def sglang_item(rid: str) -> dict[str, Any]:
    return {"text": "ab", "output_ids": [5, 6], "meta_info": {
        "id": rid, "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 3, "completion_tokens": 2,
        "cached_tokens": 0, "weight_version": "1", "weight_versions": [{"version": "1", "start": 0, "end": 2}],
        "output_token_logprobs": [[-0.5, 5, None], [-0.25, 6, None]],
        "input_token_logprobs": [[None, 1, None], [-0.75, 2, None], [-0.5, 3, None]],
        "routed_experts": base64.b64encode(bytes(16)).decode()}}


async def recording_server(calls: list[tuple[str, str, Any]]) -> web.AppRunner:
    """Answers whatever our client asks, as SGLang would in shape, and records each request."""
    async def handle(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = json.loads(raw) if raw.strip() else None
        calls.append((request.method, request.path, body))
        if request.path == "/generate":
            if body.get("stream"):
                response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await response.prepare(request)
                await response.write(f"data: {json.dumps(sglang_item('s'))}\n\ndata: [DONE]\n\n".encode())
                return response
            return web.json_response(sglang_item(body.get("rid") or "r"))
        if request.path == "/health":
            return web.Response()
        return web.json_response({"success": True, "message": "", "loads": []})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner


async def exercise_client(url: str) -> set[str]:
    """Every public method of EngineClient and SGLangBackend, with every optional field set."""
    called: set[str] = set()
    params = GenerateParams(max_new_tokens=2, temperature=0.5, top_p=0.9, top_k=5, stop=("x",), seed=3,
                            return_routed_experts=True)
    backend = SGLangBackend(url)
    await backend.generate([1, 2], params, version=0, rid="b1")
    _ = [o async for o in backend.generate_stream([1, 2], params, version=0, rid="b2")]
    for name, call in (("abort", backend.abort("b")), ("abort_all", backend.abort()), ("pause", backend.pause("retract")),
                       ("resume", backend.resume()), ("flush_cache", backend.flush_cache()),
                       ("health", backend.health()), ("group_ranks", backend.group_ranks()),
                       # the distributed transport's conversation (miles_async/actors/external.py), every field set
                       ("join_weight_group", backend.join_weight_group("127.0.0.1", 1, 1, 2, "g", "gloo")),
                       ("begin_weight_update", backend.begin_weight_update()),
                       ("receive_weights", backend.receive_weights(
                           bucket_requests(layout_to_json(layout_of([[("w", torch.zeros(2))]])), "4", True)[0], "g")),
                       ("end_weight_update", backend.end_weight_update()),
                       ("leave_weight_group", backend.leave_weight_group("g"))):
        await call
    await backend.close()
    # LoRA pushed as adapters (miles_async/actors/external.py): every request names the adapter, which is
    # replaced by unloading and loading it again
    lora = SGLangBackend(url, adapter="policy-lora")
    await lora.generate([1, 2], params, version=0, rid="l1")
    _ = [o async for o in lora.generate_stream([1, 2], params, version=0, rid="l2")]
    await lora.load_adapter("policy-lora", "/adapters/v1")
    # a distillation teacher's scoring request (miles_async/actors/teacher.py): prefill only, log-probs from a start
    assert await lora.score([1, 2, 3], 2) == [-0.5]
    await lora.close()
    async with EngineClient(url) as client:
        calls = {
            "generate": client.generate(input_ids=[1, 2], sampling_params={"max_new_tokens": 1}, rid="c",
                                        return_logprob=True, return_routed_experts=True, logprob_start_len=0,
                                        top_logprobs_num=2, return_text_in_logprobs=True),
            "health": client.health(), "wait_healthy": client.wait_healthy(5), "model_info": client.model_info(),
            "server_info": client.server_info(), "loads": client.loads(), "flush_cache": client.flush_cache(),
            "abort": client.abort("c"), "pause": client.pause("in_place"), "resume": client.resume(),
            "update_weights_from_disk": client.update_weights_from_disk("/ckpt", weight_version="2",
                                                                        abort_all_requests=True, flush_cache=False),
            "update_weight_version": client.update_weight_version("3"),
            "init_weights_update_group": client.init_weights_update_group("127.0.0.1", 1, 1, 2, group_name="g",
                                                                          backend="gloo"),
            "update_weights_from_distributed": client.update_weights_from_distributed(
                ["w"], ["float32"], [[2]], group_name="g", weight_version="4", flush_cache=False),
            "destroy_weights_update_group": client.destroy_weights_update_group("g"),
            "begin_weight_update": client.begin_weight_update(), "end_weight_update": client.end_weight_update(),
            "load_lora_adapter": client.load_lora_adapter("policy-lora", "/adapters/v1"),
            "unload_lora_adapter": client.unload_lora_adapter("policy-lora"),
        }
        for name, call in calls.items():
            await call
            called.add(name)
        _ = [o async for o in client.generate_stream(input_ids=[1], sampling_params={}, return_logprob=True)]
        called |= {"generate_stream", "close"}
    return called


def test_every_route_and_field_our_client_sends_is_sglangs(sglang):
    calls: list[tuple[str, str, Any]] = []

    async def scenario():
        runner = await recording_server(calls)
        try:
            return await exercise_client(f"http://127.0.0.1:{runner.addresses[0][1]}")
        finally:
            await runner.cleanup()

    called = run(scenario())
    public = {n for n, _ in inspect.getmembers(EngineClient, inspect.isfunction) if not n.startswith("_")}
    assert public <= called, f"EngineClient methods this test does not exercise: {sorted(public - called)}"
    sent: dict[str, set[str]] = {}
    sampling_keys: set[str] = set()
    for method, path, body in calls:
        assert path in sglang.routes, f"our client calls {path}, which SGLang 0.5.23 does not serve"
        methods, struct = sglang.routes[path]
        assert method in methods, f"our client sends {method} {path}; SGLang takes {sorted(methods)}"
        keys = set(body or {})
        sent.setdefault(f"{method} {path} ({struct})", set()).update(keys)
        if keys:
            assert struct is not None, f"{path}: SGLang's handler takes no body, ours sends {sorted(keys)}"
            assert keys <= sglang.structs[struct], f"{path}: {sorted(keys - sglang.structs[struct])} not in {struct}"
        sampling_keys |= set((body or {}).get("sampling_params") or {})
    assert sampling_keys <= sglang.structs["SamplingParams"], sorted(sampling_keys - sglang.structs["SamplingParams"])
    sglang.record("client requests: fields sent per route (each one a field of SGLang's struct)",
                  {route: sorted(keys) for route, keys in sorted(sent.items())})
    sglang.record("client sampling_params keys (SGLang's SamplingParams fields)", sorted(sampling_keys))


class RecordingDict(dict):
    def __init__(self, *args: Any, reads: set[str]) -> None:
        super().__init__(*args)
        self.reads = reads

    def get(self, key: Any, default: Any = None) -> Any:
        self.reads.add(key)
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        self.reads.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: Any) -> bool:
        self.reads.add(key)
        return super().__contains__(key)


def test_every_meta_info_key_parse_output_reads_is_one_sglang_writes(sglang):
    meta_reads: set[str] = set()
    top_reads: set[str] = set()
    with_spans = sglang_item("r")
    without_spans = sglang_item("r")
    del without_spans["meta_info"]["weight_versions"]
    for item in (with_spans, without_spans):
        meta = RecordingDict(item["meta_info"], reads=meta_reads)
        parse_output(RecordingDict({**item, "meta_info": meta}, reads=top_reads), version=0)
    assert meta_reads <= sglang.meta_info_keys, sorted(meta_reads - sglang.meta_info_keys)
    assert top_reads <= sglang.output_keys, sorted(top_reads - sglang.output_keys)
    span_keys = set(with_spans["meta_info"]["weight_versions"][0])
    assert span_keys <= sglang.structs["WeightVersionSpan"]
    sglang.record("parse_output: meta_info keys read (each one tokenizer_manager writes)", sorted(meta_reads))
    sglang.record("parse_output: output keys read", sorted(top_reads))


# ----- our server's answers -----

def test_our_servers_routes_and_answers_have_sglangs_keys(sglang, model_dir):
    engine = Engine.from_pretrained(str(model_dir), config=EngineConfig(kv_cache_mib=8))

    async def scenario():
        async with EngineServer(engine) as server, EngineClient(server.url) as client:
            routes = {(r.method, r.resource.canonical) for r in create_app(engine).router.routes()}
            out = await client.generate(input_ids=[5, 6, 7, 8], sampling_params={"max_new_tokens": 3},
                                        return_logprob=True, logprob_start_len=1, top_logprobs_num=2,
                                        return_text_in_logprobs=True)
            return routes, out, await client.model_info(), await client.server_info(), await client.loads()

    routes, out, info, server_info, loads = run(scenario())
    ours = {path for method, path in routes if method != "HEAD"}
    theirs = set(sglang.routes) | set(OURS_ONLY)
    assert ours <= theirs, f"routes SGLang 0.5.23 does not have: {sorted(ours - theirs)}"
    for method, path in routes:
        if path in sglang.routes and method not in ("HEAD", "*"):
            assert method in sglang.routes[path][0], (method, path, sglang.routes[path][0])
    meta = out["meta_info"]
    assert set(out) <= sglang.output_keys and set(meta) <= sglang.meta_info_keys, sorted(set(meta) - sglang.meta_info_keys)
    span_types = sglang.annotations["WeightVersionSpan"]
    for span in meta["weight_versions"]:
        assert set(span) == set(span_types) and isinstance(span["version"], str) and span_types["version"] == "str"
    assert set(info) <= sglang.model_info_keys, sorted(set(info) - sglang.model_info_keys)
    assert set(server_info) <= sglang.server_info_keys, sorted(set(server_info) - sglang.server_info_keys)
    assert set(loads) <= sglang.loads_keys and set(loads["loads"][0]) <= sglang.load_keys
    sglang.record(f"server routes (all SGLang's; ours only: {', '.join(OURS_ONLY)})", sorted(ours))
    sglang.record("server /generate meta_info keys", sorted(meta))
    sglang.record("server /model_info keys", sorted(info))
    sglang.record("server /server_info keys (ServerArgs fields and server_info's own)", sorted(server_info))
    sglang.record("server /v1/loads keys", {"top": sorted(loads), "per rank": sorted(loads["loads"][0])})


def test_a_speculating_servers_metrics_are_sglangs_and_the_client_reads_them(sglang, model_dir):
    engine = Engine.from_pretrained(str(model_dir), config=EngineConfig(kv_cache_mib=8, speculative_tokens=2))

    async def scenario():
        async with EngineServer(engine) as server, EngineClient(server.url) as client:
            return await client.generate(input_ids=[5, 6, 7, 8], sampling_params={"max_new_tokens": 6,
                                                                                  "ignore_eos": True})

    out = run(scenario())
    meta = out["meta_info"]
    spec = {k for k in meta if k.startswith("spec_")}
    assert spec == {"spec_verify_ct", "spec_num_proposed_drafts", "spec_num_correct_drafts", "spec_accept_rate",
                    "spec_accept_length"}
    assert spec <= sglang.meta_info_keys, sorted(spec - sglang.meta_info_keys)
    parsed = parse_output(out, version=0)
    assert parsed.spec_verify_ct == meta["spec_verify_ct"] > 0
    assert parsed.spec_draft_tokens == meta["spec_num_proposed_drafts"] > 0
    assert parsed.spec_accepted_drafts == meta["spec_num_correct_drafts"]
    assert meta["spec_accept_length"] == pytest.approx(6 / meta["spec_verify_ct"])
    sglang.record("server /generate meta_info keys of a speculating engine", sorted(spec))


# ----- the weight-update group, against SGLang's own code -----

SGLANG_MEMBER = """
import ast, sys, zipfile, torch
wheel, port, name = sys.argv[1], int(sys.argv[2]), sys.argv[3]
source = zipfile.ZipFile(wheel).read("sglang/srt/utils/common.py").decode()
fn = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "init_custom_process_group")
release = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
scope = {"torch": torch, "torch_release": release}
exec(compile(ast.Module(body=[fn], type_ignores=[]), "sglang/srt/utils/common.py", "exec"), scope)
group = scope["init_custom_process_group"](backend="gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2,
                                           rank=1, group_name=name)
for shape, dtype in ((2, 3), torch.float32), ((4,), torch.bfloat16):  # as receive_weights_from_distributed does
    tensor = torch.empty(shape, dtype=dtype)
    torch.distributed.broadcast(tensor, src=0, group=group)
    print(tensor.float().sum().item(), flush=True)
# as SGLang's destroy_weights_update_group does: a gloo group left at exit can abort the
# interpreter's teardown ("terminate called without an active exception", SIGABRT)
torch.distributed.destroy_process_group(group)
"""


def test_sglangs_own_group_code_joins_the_pushers_group_and_receives(sglang, tmp_path):
    """The store keys and the sequence-number step must be SGLang's, or its member waits forever."""
    from miles_async.actors.distributed import send_tensors

    store = WeightGroup.open_store("127.0.0.1", 2, 30)
    # the member binds gloo to loopback whatever interface an earlier test in this worker named
    env = {k: v for k, v in os.environ.items() if k not in ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME")}
    member = subprocess.Popen([sys.executable, "-c", SGLANG_MEMBER, str(_wheel()), str(store.port), "miles-g"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        group = WeightGroup.join("127.0.0.1", store.port, 0, 2, store=store, name="miles-g", sglang=True,
                                 timeout_s=30)
        send_tensors([[("a", torch.ones(2, 3))], [("b", torch.full((4,), 0.5, dtype=torch.bfloat16))]], group, "cpu")
        out, err = member.communicate(timeout=TIMEOUT_S)
        group.close()
    finally:
        member.kill()
    assert member.returncode == 0, (out, err[-2000:])
    assert [float(x) for x in out.split()] == [6.0, 2.0]
    sglang.record("weight-update group: SGLang's init_custom_process_group joined our rank 0 (gloo)", True)


def test_the_lora_flags_an_sglang_engine_starts_with_are_sglangs_server_args(sglang, tmp_path):
    """`ExternalEngineActor` starts SGLang with LoRA on when the trainer's adapters are pushed as
    such: each flag is one of SGLang's ServerArgs (--enable-lora -> enable_lora)."""
    from miles_async.actors.external import ExternalEngineActor
    from miles_async.models.lora import LoraConfig

    actor = ExternalEngineActor("sglang", str(tmp_path), lora=LoraConfig(rank=8))
    flags = [a[2:].replace("-", "_") for a in actor._lora_args() if a.startswith("--")]
    assert flags == ["enable_lora", "max_lora_rank", "max_loras_per_batch", "lora_target_modules"]
    missing = [f for f in flags if f not in sglang.server_info_keys]
    assert not missing, f"SGLang 0.5.23's ServerArgs have no {missing}"
    sglang.record("lora_server_args", flags)
