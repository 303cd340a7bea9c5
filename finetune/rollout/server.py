"""`ft rollout-server`: a vLLM engine on its own devices that a trainer sends prompts and weights to, and its client.

JSON over HTTP (one engine call at a time; requests from several trainer ranks queue):
    GET  /health              {"ready": true, "lora": bool, "version": int}
    POST /generate            {"prompts": [[ids]], "seed", "temperature", "top_p", "max_new_tokens", "stop": [ids]}
                              -> {"completions": [{"ids": [...], "logps": [...]}]}
    POST /score               {"sequences": [[ids]]} -> {"logps": [[...]]}: the engine's log-prob of each token
    POST /adapter             {"version", "files": {name: base64}}: the trained adapter, served as a new LoRA request
    POST /weights/begin?version=V   an in-place update of full weights begins (generation waits until it ends)
    POST /weights             body: safetensors bytes of some parameters (a decoder layer), in order
    POST /weights/done        the update is complete: the prefix cache is reset
    POST /nccl/<init|start|update|finish>   vLLM's weight-transfer control calls: full weights over NCCL (GPUs)
    POST /shutdown
A token (FT_ROLLOUT_TOKEN in both environments) is required as `Authorization: Bearer <token>` when set. Bad requests
get a 400 with what was wrong; the server keeps serving.
"""

from __future__ import annotations

import base64
import hmac
import json
import queue
import shutil
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from finetune.errors import FtError
from finetune.rollout import Completion

MAX_JSON_BYTES = 512 * 2**20  # prompts, completions, adapters
MAX_PART_BYTES = 64 * 2**30  # one layer of weights
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


class BadRequest(ValueError):
    pass


class RolloutService:
    """The engine behind the HTTP handlers (usable without HTTP, for tests)."""

    def __init__(self, engine):
        self.engine, self.lock, self.version = engine, threading.Lock(), -1
        self.update = None  # (version, parts queue, loading thread, errors) while an in-place update runs
        self.folder = Path(tempfile.mkdtemp(prefix="ft-rollout-server-"))  # adapters received (removed on close)

    def generate(self, body: dict) -> dict:
        prompts = body.get("prompts")
        if not isinstance(prompts, list) or not prompts or not all(_ids(p) for p in prompts):
            raise BadRequest("prompts: expected a non-empty list of lists of token ids")
        stop = body.get("stop", [])
        if not _ids(stop, empty=True):
            raise BadRequest("stop: expected a list of token ids")
        try:
            seed, temperature = int(body["seed"]), float(body["temperature"])
            top_p, max_new = float(body["top_p"]), int(body["max_new_tokens"])
        except (KeyError, TypeError, ValueError) as e:
            raise BadRequest(f"seed, temperature, top_p, max_new_tokens: each must be a number ({e})") from None
        if not (temperature >= 0 and 0 < top_p <= 1 and max_new >= 1):
            raise BadRequest("temperature must be >= 0, top_p in (0, 1], max_new_tokens >= 1")
        with self.lock:
            out = self.engine.sample(prompts, seed, temperature, top_p, max_new, stop)
        return {"completions": [{"ids": c.ids, "logps": c.logps} for c in out], "version": self.version}

    def score(self, body: dict) -> dict:
        """The engine's log-prob of each token after the first of each sequence (checks that weights arrived)."""
        sequences = body.get("sequences")
        if not isinstance(sequences, list) or not sequences or not all(_ids(s) and len(s) > 1 for s in sequences):
            raise BadRequest("sequences: expected a non-empty list of lists of at least two token ids")
        with self.lock:
            return {"logps": self.engine.score(sequences)}

    def adapter(self, body: dict) -> dict:
        files, version = body.get("files"), body.get("version")
        if not isinstance(version, int) or not isinstance(files, dict) or set(files) != set(ADAPTER_FILES):
            raise BadRequest(f"expected {{version: int, files: {{{', '.join(ADAPTER_FILES)}: base64}}}}")
        path = self.folder / f"adapter-{version:08d}"
        path.mkdir(parents=True, exist_ok=True)
        try:
            for name in ADAPTER_FILES:
                (path / name).write_bytes(base64.b64decode(files[name], validate=True))
        except (ValueError, TypeError) as e:
            raise BadRequest(f"files: not base64 ({e})") from None
        with self.lock:
            self.engine.serve_adapter(str(path), version)
            self.version = version
        for old in sorted(self.folder.glob("adapter-*"))[:-2]:
            shutil.rmtree(old, ignore_errors=True)
        return {"version": version}

    def begin_weights(self, version: int) -> dict:
        """Start an in-place update: one reload in a worker thread consumes the parts as they arrive (vLLM processes
        each layer once it is complete); generation waits until it is done."""
        if self.update is not None:
            raise BadRequest("an update is already in progress: finish it with /weights/done first")
        parts: queue.Queue = queue.Queue(maxsize=2)
        errors: list[BaseException] = []

        def consume():
            def named():
                while (part := parts.get()) is not None:
                    yield from part

            with self.lock:
                try:
                    self.engine.load(named())
                except BaseException as e:  # reported by /weights/done
                    errors.append(e)
                    while parts.get() is not None:  # drain what the client still sends
                        pass

        thread = threading.Thread(target=consume, daemon=True)
        thread.start()
        self.update = (version, parts, thread, errors)
        return {"version": version}

    def weights(self, data: bytes) -> dict:
        from safetensors.torch import load as load_safetensors

        if self.update is None:
            raise BadRequest("no update in progress: start one with /weights/begin?version=V")
        try:
            tensors = load_safetensors(data)
        except Exception as e:  # safetensors reports a malformed header in several exception types
            raise BadRequest(f"body: not a safetensors payload ({type(e).__name__}: {str(e)[:200]})") from None
        self.update[1].put(list(tensors.items()))
        return {"tensors": len(tensors)}

    def weights_done(self) -> dict:
        if self.update is None:
            raise BadRequest("no update in progress")
        (version, parts, thread, errors), self.update = self.update, None
        parts.put(None)
        thread.join()
        if errors:
            raise FtError(f"loading the weights failed: {type(errors[0]).__name__}: {errors[0]}")
        self.version = version
        return {"version": version}

    def nccl(self, op: str, body: dict) -> dict:
        """vLLM's weight-transfer control calls (rollout/nccl.py); the tensors travel over NCCL, not here."""
        if not self.engine.spec.weight_transfer:
            raise BadRequest("this server receives weights over HTTP only (NCCL needs GPUs)")
        llm = self.engine.llm
        if op == "init":
            llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": body.get("init_info")})
        elif op == "start":
            llm.collective_rpc("start_weight_update")
        elif op == "update":
            llm.collective_rpc("update_weights", kwargs={"update_info": body.get("update_info")})
        elif op == "finish":
            llm.collective_rpc("finish_weight_update")
            llm.reset_prefix_cache()
        else:
            raise BadRequest(f"no NCCL operation {op!r}")
        return {"ok": True}

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def _ids(value, empty: bool = False) -> bool:
    return isinstance(value, list) and (empty or bool(value)) and all(type(t) is int and t >= 0 for t in value)


def request_handler(service: RolloutService, token: str | None, stop: threading.Event):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # no per-request lines (the trainer logs what matters)
            pass

        def _reply(self, code: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _authorised(self) -> bool:
            if token is None:
                return True
            given = self.headers.get("Authorization", "")
            if hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                return True
            self._reply(401, {"error": "missing or wrong token (FT_ROLLOUT_TOKEN)"})
            return False

        def _body(self, limit: int) -> bytes:
            try:
                size = int(self.headers.get("Content-Length", "0"))
            except ValueError:
                raise BadRequest("Content-Length is not a number") from None
            if size < 0 or size > limit:
                raise BadRequest(f"body of {size} bytes: at most {limit} are accepted")
            return self.rfile.read(size)

        def _json(self) -> dict:
            try:
                body = json.loads(self._body(MAX_JSON_BYTES))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise BadRequest(f"body is not JSON ({e})") from None
            if not isinstance(body, dict):
                raise BadRequest("body must be a JSON object")
            return body

        def do_GET(self) -> None:
            try:
                self._get()
            except Exception as e:  # the server keeps serving; the caller gets the reason
                self._reply(500, {"error": f"{type(e).__name__}: {e}"})

        def _get(self) -> None:
            if not self._authorised():
                return
            if self.path != "/health":
                return self._reply(404, {"error": f"no endpoint GET {self.path}"})
            spec = service.engine.spec
            self._reply(
                200,
                {
                    "ready": True,
                    "lora": bool(spec.lora_rank),
                    "version": service.version,
                    "nccl": spec.weight_transfer,
                    "workers": spec.tensor_parallel,
                },
            )

        def do_POST(self) -> None:
            if not self._authorised():
                return
            path, _, query = self.path.partition("?")
            try:
                if path == "/generate":
                    return self._reply(200, service.generate(self._json()))
                if path == "/score":
                    return self._reply(200, service.score(self._json()))
                if path == "/adapter":
                    return self._reply(200, service.adapter(self._json()))
                if path == "/weights/begin":
                    version = dict(p.split("=", 1) for p in query.split("&") if "=" in p).get("version", "")
                    if not version.isdigit():
                        raise BadRequest("/weights/begin needs ?version=<int>")
                    self._body(MAX_JSON_BYTES)
                    return self._reply(200, service.begin_weights(int(version)))
                if path.startswith("/nccl/"):
                    return self._reply(200, service.nccl(path.removeprefix("/nccl/"), self._json()))
                if path == "/weights":
                    return self._reply(200, service.weights(self._body(MAX_PART_BYTES)))
                if path == "/weights/done":
                    self._body(MAX_JSON_BYTES)
                    return self._reply(200, service.weights_done())
                if path == "/shutdown":
                    self._body(MAX_JSON_BYTES)
                    self._reply(200, {"stopping": True})
                    stop.set()
                    return None
                return self._reply(404, {"error": f"no endpoint POST {path}"})
            except BadRequest as e:
                return self._reply(400, {"error": str(e)})
            except Exception as e:  # the engine failed: the server keeps serving, the caller gets the reason
                return self._reply(500, {"error": f"{type(e).__name__}: {e}"})

    return Handler


def serve(spec, host: str, port: int, token: str | None, ready=None) -> None:
    """Run the server until /shutdown or a signal. `ready(url)` is called once the engine is loaded."""
    import signal

    import torch

    from finetune.rollout.vllm import VllmRollout, prepare_environment

    gpu = torch.cuda.is_available()
    prepare_environment(gpu)
    service = RolloutService(VllmRollout(replace(spec, weight_transfer=gpu)))  # NCCL where there are GPUs
    stop = threading.Event()
    httpd = ThreadingHTTPServer((host, port), request_handler(service, token, stop))
    httpd.daemon_threads = True
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    url = f"http://{host}:{httpd.server_address[1]}"
    (ready or (lambda u: print(f"ft rollout-server: listening on {u}", flush=True)))(url)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        httpd.shutdown()
        service.close()


class RemoteRollout:
    """The trainer's side of a rollout server: prompts out, completions with log-probs back; weights pushed by rank 0
    (every rank takes part in gathering them)."""

    name = "vllm-server"

    def __init__(self, url: str, section, stop: list[int], token: str | None = None, timeout_s: float = 3600):
        self.url, self.s, self.stop, self.token, self.timeout = url.rstrip("/"), section, list(stop), token, timeout_s
        self.health = wait_ready(self.url, token, timeout_s=600)
        self.nccl = None  # the NCCL transfer group, opened at the first full update on GPUs

    def _post(self, path: str, data: bytes, content_type: str = "application/json") -> dict:
        request = urllib.request.Request(self.url + path, data=data, method="POST")
        request.add_header("Content-Type", content_type)
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as e:
            detail = e.read()[:500].decode(errors="replace")
            raise FtError(f"rollout server {self.url}{path} answered {e.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as e:
            raise FtError(
                f"rollout server {self.url} cannot be reached ({e}); check that it is running "
                "(its log: rollout-server.log in the run folder when ft train started it)"
            ) from None

    def generate(self, prompts: list[list[int]], seed: int) -> list[Completion]:
        body = {
            "prompts": prompts,
            "seed": seed,
            "temperature": self.s.temperature,
            "top_p": self.s.top_p,
            "max_new_tokens": self.s.max_new_tokens,
            "stop": self.stop,
        }
        out = self._post("/generate", json.dumps(body).encode())
        return [Completion(c["ids"], c.get("logps")) for c in out["completions"]]

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        return self._post("/score", json.dumps({"sequences": sequences}).encode())["logps"]

    def update(self, weights) -> None:
        main = weights.runtime.is_main
        if weights.kind == "adapter":
            folder = weights.adapter_folder()
            if main:
                files = {n: base64.b64encode((folder / n).read_bytes()).decode() for n in ADAPTER_FILES}
                self._post("/adapter", json.dumps({"version": weights.version, "files": files}).encode())
        elif self.health.get("nccl") and _cuda():
            if self.nccl is None:  # every rank: rank 0 opens the transfer group, the others take part in gathering
                from finetune.rollout.nccl import NcclSender

                post = lambda path, body: self._post(path, json.dumps(body).encode())  # noqa: E731
                self.nccl = NcclSender(weights.engine, weights.runtime, post, int(self.health.get("workers") or 1))
            self.nccl.send()
        else:
            from safetensors.torch import save as save_safetensors

            from finetune.rollout.weights import layer_groups

            if not main:
                for _ in weights.tensors():  # the other ranks only take part in gathering each parameter
                    pass
            else:
                self._post(f"/weights/begin?version={weights.version}", b"{}")
                on_cpu = ((n, t.to("cpu", copy=True)) for n, t in weights.tensors())
                for group in layer_groups(on_cpu):  # one decoder layer in host memory at a time
                    data = save_safetensors({n: t.contiguous() for n, t in group})
                    self._post("/weights", data, "application/octet-stream")
                self._post("/weights/done", b"{}")
        weights.runtime.barrier()  # no rank samples before the server has the new weights

    def sleep(self, reloading: bool = False) -> None:
        pass  # the server's devices are its own

    def wake(self) -> None:
        pass

    def close(self) -> None:
        pass


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def wait_ready(url: str, token: str | None, timeout_s: float, process=None) -> dict:
    """Poll /health until the server answers; a server process that exits first is an error."""
    deadline = time.monotonic() + timeout_s
    request = urllib.request.Request(url.rstrip("/") + "/health")
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    last = None
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise FtError(f"the rollout server exited with code {process.returncode} before it was ready")
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return json.loads(response.read())
        except (urllib.error.URLError, OSError) as e:
            last = e
            time.sleep(0.5)
    raise FtError(f"rollout server {url} did not answer within {timeout_s:.0f} s ({last})")


def main(argv: list[str] | None = None) -> None:
    """`python -m finetune.rollout.server SPEC_JSON HOST PORT`: what `ft train` starts (the token comes from the
    environment)."""
    import os

    from finetune.rollout.vllm import EngineSpec

    args = sys.argv[1:] if argv is None else argv
    spec = EngineSpec(**json.loads(args[0]))
    serve(spec, args[1], int(args[2]), os.environ.get("FT_ROLLOUT_TOKEN"))


if __name__ == "__main__":
    main()
