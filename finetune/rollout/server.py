"""The trainer's side of rollouts served by vLLM's own OpenAI-compatible server (`vllm serve`, `placement: server`).

Generation: each prompt is one `/v1/completions` request (prompt as token ids, its own seed, the sampled token's
log-prob and the completion's token ids returned), and every request of every trainer rank is in flight at once, so
that vLLM's continuous batching batches them; nothing is serialised on the trainer's side. With several servers
(`method.rollout.url` as a list: data-parallel engines), each rank's prompts are balanced by expected length
(balance: a group's repeated prompts stay on one server, for its prefix cache), and the completions come back in
prompt order.

Weights, through vLLM's own routes (rollout/serve.py enables them):
    adapter        rank 0 writes it (RUN/rollout/adapter-<version>), every server loads it as a new LoRA
                   (`/v1/load_lora_adapter`) and drops the previous one (`/v1/unload_lora_adapter`)
    full, GPUs     vLLM's NCCL weight transfer (`/init_weight_transfer_engine`, `/start_weight_update`,
                   `/update_weights`, `/finish_weight_update`; rollout/nccl.py), where vLLM is importable here
    full, else     vLLM's transfer backends are CUDA-only (NCCL, CUDA IPC), so rank 0 writes the weights
                   (RUN/rollout/weights-<version>) and each server reloads them in place from that folder
                   (`/collective_rpc` reload_weights)
Full weights change between `/pause?mode=keep` and `/resume`: vLLM stops stepping, requests in flight stay where they
are (asynchronous rollouts keep generating across updates), and before it steps again the prefix cache is emptied with
the running requests preempted (`/reset_prefix_cache?reset_running_requests=true`), so that no KV block computed with
the old weights is read again: a request that straddles an update recomputes its prompt and the tokens it has, and
samples the rest with the new weights (its tokens' log-probs are those of the weights that sampled them). An adapter
never changes under a request: each rollout's requests name the adapter of the rollout's version, and an adapter is
unloaded once no rollout still in flight names it (`Weights.in_flight`: the same on every rank).
The folders are read by the server: a server on another node needs the run folder on a shared file system (as
checkpoints on several nodes already do). A server that stops answering ends the job with its address and the fix
(`ft train ... --resume` continues from the last checkpoint); no request waits longer than `method.rollout.timeout_s`.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from finetune.errors import FtError
from finetune.rollout import Completion

MAX_IN_FLIGHT = 512  # requests one rank keeps open at once (vLLM queues what it cannot batch yet)
READY_TIMEOUT_S = 600  # a server given by URL may still be loading its model
LOG_HINT = (
    "its log: rollout-server.log in the run folder when ft train started it (placement: ray: rollout-engine-N.log)"
)


class ServerError(FtError):
    """A rollout server answered with an error, or did not answer."""


def balance(prompts: list[list[int]], servers: int, new_tokens: int) -> list[int]:
    """The server of each prompt, balanced by expected length: a group (a run of equal prompts: one prompt's samples)
    stays on one server, so that its prompt is computed once there (prefix cache); groups go, the costliest first, to
    the server with the least expected tokens (prompt and completion: len(prompt) + new_tokens each) so far. The
    completions come back in prompt order whatever server made them."""
    groups, start = [], 0
    for j in range(1, len(prompts) + 1):
        if j == len(prompts) or prompts[j] != prompts[start]:
            groups.append((start, j))
            start = j
    cost = {g: (g[1] - g[0]) * (len(prompts[g[0]]) + new_tokens) for g in groups}
    load, where = [0] * servers, [0] * len(prompts)
    for g in sorted(groups, key=lambda g: -cost[g]):  # stable: equal costs keep prompt order
        server = min(range(servers), key=lambda k: load[k])
        load[server] += cost[g]
        where[g[0] : g[1]] = [server] * (g[1] - g[0])
    return where


class Http:
    """JSON over HTTP to one vLLM server, with the token and the errors ft reports."""

    def __init__(self, url: str, token: str | None, timeout_s: float):
        self.url, self.token, self.timeout = url.rstrip("/"), token, timeout_s

    def call(self, path: str, body: dict | None = None, method: str = "POST", timeout: float | None = None):
        data = None if body is None and method == "GET" else json.dumps(body or {}).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method)
        request.add_header("Content-Type", "application/json")
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(request, timeout=timeout or self.timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as e:
            detail = e.read()[:500].decode(errors="replace")
            raise ServerError(f"rollout server {self.url}{path} answered {e.code}: {detail}{_fix(e.code)}") from None
        except TimeoutError:
            raise ServerError(
                f"rollout server {self.url}{path} did not answer within {timeout or self.timeout:g} s "
                f"(method.rollout.timeout_s); {LOG_HINT}. Once it serves again, `ft train JOB --resume` continues"
            ) from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise ServerError(
                f"rollout server {self.url} cannot be reached ({reason}): it stopped or never started; {LOG_HINT}. "
                "Once it serves again (ft train starts its own again), `ft train JOB --resume` continues from the "
                "last checkpoint"
            ) from None
        return json.loads(raw) if raw[:1] in (b"{", b"[") else raw.decode(errors="replace")


def _fix(code: int) -> str:
    if code == 401:
        return "\n    fix: set FT_ROLLOUT_TOKEN to the server's API key (vLLM's --api-key / VLLM_API_KEY)"
    if code == 404:
        return (
            "\n    fix: start the server with VLLM_SERVER_DEV_MODE=1 and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 (vLLM's "
            "weight routes; `ft rollout-server JOB` does), and the model given by the trainer's job"
        )
    if code >= 500:  # the server failed (its engine died, or it is being stopped)
        return (
            f"\n    the server failed; {LOG_HINT}. Once it serves again (ft train starts its own again), "
            "`ft train JOB --resume` continues from the last checkpoint"
        )
    return ""


def wait_ready(http: Http, timeout_s: float = READY_TIMEOUT_S, process=None) -> str:
    """Poll `/health` until the server answers, then the base model's name (`/v1/models`, which also checks the
    token); a server process that exits first is an error."""
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise ServerError(f"the vLLM rollout server exited with code {process.returncode} before it was ready")
        try:
            http.call("/health", method="GET", timeout=10)
            break
        except ServerError as e:
            last = e
            time.sleep(0.5)
    else:
        raise ServerError(f"rollout server {http.url} did not answer within {timeout_s:.0f} s ({last})")
    models = http.call("/v1/models", method="GET")["data"]
    return next(m["id"] for m in models if not m.get("parent"))


class RemoteRollout:
    """The trainer's side of one or more vLLM servers: prompts out, completions with log-probs back; weights through
    vLLM's routes (every rank takes part in gathering them, rank 0 sends)."""

    name = "vllm-server"
    updates_while_generating = True  # asynchronous rollouts keep generating while weights change (see above)

    def __init__(self, urls, section, stop: list[int], token: str | None = None, timeout_s: float = 600):
        urls = [urls] if isinstance(urls, str) else list(urls)
        self.servers = [Http(u, token, timeout_s) for u in urls]
        self.s, self.stop = section, list(stop)
        self.base = [wait_ready(h) for h in self.servers]  # each server's name of the base model
        self.adapter: str | None = None  # the trained adapter's name on the servers (None: the base generates)
        self.loaded: dict[int, str] = {}  # rank 0: the adapters loaded on the servers, by version
        self.lock = threading.Lock()
        self.pool = ThreadPoolExecutor(max_workers=MAX_IN_FLIGHT, thread_name_prefix="ft-rollout")
        self.nccl = None  # vLLM's NCCL transfer, opened at the first full update on GPUs

    # ---------------------------------------------------------------- generation
    def generate(self, prompts: list[list[int]], seed: int) -> list[Completion]:
        """One request per prompt, all in flight at once; prompt j draws from seed + j (as a colocated engine)."""
        where = balance(prompts, len(self.servers), self.s.max_new_tokens)
        with self.lock:
            adapter = self.adapter  # the rollout's adapter, whatever update comes while it generates
        futures = [self.pool.submit(self._complete, where[j], p, seed + j, adapter) for j, p in enumerate(prompts)]
        return [f.result() for f in futures]

    def _complete(self, server: int, prompt: list[int], seed: int, adapter: str | None) -> Completion:
        body = {
            "model": adapter or self.base[server],
            "prompt": prompt,
            "max_tokens": self.s.max_new_tokens,
            "temperature": self.s.temperature,
            "top_p": self.s.top_p,
            "seed": seed,
            "stop_token_ids": self.stop,
            "logprobs": 0,  # the sampled token's log-prob (vLLM's raw one, before temperature)
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        http = self.servers[server]
        (choice,) = http.call("/v1/completions", body)["choices"]
        if choice.get("finish_reason") == "abort":  # cut short: never trained on
            raise ServerError(
                f"rollout server {http.url} aborted a completion (was it paused with mode=abort, or stopped?); "
                f"{LOG_HINT}. `ft train JOB --resume` continues from the last checkpoint"
            )
        return Completion(list(choice["token_ids"]), list(choice["logprobs"]["token_logprobs"]))

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """The server's log-prob of each token after the first of each sequence (checks that weights arrived)."""
        out = []
        for seq in sequences:
            body = {"model": self.adapter or self.base[0], "prompt": seq, "max_tokens": 1, "prompt_logprobs": 0}
            (choice,) = self.servers[0].call("/v1/completions", body)["choices"]
            out.append([entry[str(t)]["logprob"] for entry, t in zip(choice["prompt_logprobs"][1:], seq[1:])])
        return out

    # ---------------------------------------------------------------- weights
    def update(self, weights) -> None:
        main = weights.runtime.is_main
        if weights.kind == "adapter":
            folder = weights.adapter_folder()  # every rank: rank 0 writes it
            name = f"ft-adapter-{weights.version}"
            if main:
                for http in self.servers:
                    self._load_adapter(http, name, str(Path(folder).resolve()))
                self.loaded[weights.version] = name
            with self.lock:
                self.adapter = name
            if main:  # after the barrier in adapter_folder: every rank has its older rollouts in hand
                self._unload(keep={weights.version, *weights.in_flight})
        elif self._nccl_possible():
            if self.nccl is None:  # every rank: rank 0 opens the transfer group, the others take part in gathering
                from finetune.rollout.nccl import NcclSender

                http = self.servers[0]
                workers = http.call("/get_world_size", method="GET")["world_size"]
                self.nccl = NcclSender(weights.engine, weights.runtime, http.call, int(workers))
            if main:
                self.servers[0].call("/pause?mode=keep")
            try:
                self.nccl.send()
                if main:
                    _recompute(self.servers[0])
            finally:
                if main:
                    self.servers[0].call("/resume")
        else:
            folder = str(Path(weights.checkpoint_folder()).resolve())  # every rank: rank 0 writes it
            if main:
                for http in self.servers:
                    _reload(http, folder)
        weights.runtime.barrier()  # no rank samples before every server has the new weights

    def _load_adapter(self, http: Http, name: str, folder: str) -> None:
        body = {"lora_name": name, "lora_path": folder}
        try:
            http.call("/v1/load_lora_adapter", body)
        except ServerError as e:
            if "already been loaded" not in str(e):  # a server that outlived an earlier run of this job
                raise
            http.call("/v1/unload_lora_adapter", {"lora_name": name})
            http.call("/v1/load_lora_adapter", body)

    def _unload(self, keep: set[int]) -> None:
        """Drop every adapter this client loaded but the versions in `keep` (the new one, those rollouts in flight
        name) from every server."""
        for version in [v for v in self.loaded if v not in keep]:
            for http in self.servers:
                http.call("/v1/unload_lora_adapter", {"lora_name": self.loaded[version]})
            del self.loaded[version]

    def _nccl_possible(self) -> bool:
        """vLLM's NCCL transfer: GPUs here, vLLM importable here, and one server (its data-parallel engines join one
        group)."""
        import importlib.util

        import torch

        return torch.cuda.is_available() and len(self.servers) == 1 and importlib.util.find_spec("vllm") is not None

    def sleep(self, reloading: bool = False) -> None:
        pass  # the server's devices are its own

    def wake(self) -> None:
        pass

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _reload(http: Http, folder: str) -> None:
    """Full weights in place from `folder`: no step runs until the weights are in and no KV block computed with the old
    ones is left (requests in flight are kept, and recompute what they have)."""
    http.call("/pause?mode=keep")
    try:
        http.call("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": folder}})
        _recompute(http)
    finally:
        http.call("/resume")


def _recompute(http: Http) -> None:
    """Empty a paused server's prefix cache, preempting its running requests (they recompute their KV when it
    resumes); vLLM says whether every block was freed. (vLLM 0.32 already does this when it pauses, clear_cache being
    true by default: v1/engine/core.py `_finish_pause`; its route documents clear_cache as ignored under mode=keep, so
    ft asks for it explicitly once the new weights are in.)"""
    answer = http.call("/reset_prefix_cache?reset_running_requests=true")
    if isinstance(answer, dict) and answer.get("success") is False:
        raise ServerError(
            f"rollout server {http.url} could not empty its prefix cache after a weight update (blocks still held); "
            f"{LOG_HINT}"
        )
