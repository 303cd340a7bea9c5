"""GRPO's rollouts served by vLLM's own server (`vllm serve`, placement: server) on CPU, with vLLM's CPU build: after a
weight sync through vLLM's routes the server's log-probs equal the trainer's (an adapter loaded as a new LoRA, full
weights reloaded in place, also under requests in flight), GRPO through a server ft train starts learns with rollouts
generated ahead, and a server killed mid-run ends the job with a message, after which `ft train --resume` starts
another and finishes the run.

Runs in an environment with vLLM (the main one has none, and this file skips there):
    OMP_NUM_THREADS=1 /path/to/vllm-env/bin/python -m pytest -q tests/test_vllm_serve.py
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from finetune.distributed.runtime import Runtime  # noqa: E402
from finetune.rollout.serve import server_command, server_env  # noqa: E402
from finetune.rollout.server import Http, RemoteRollout, wait_ready  # noqa: E402
from finetune.rollout.vllm import EngineSpec  # noqa: E402
from finetune.rollout.weights import Weights  # noqa: E402
from tests.helpers import free_port, ft_train  # noqa: E402
from tests.rollout_helpers import SEQUENCES, largest_gap, one_training_step, rows, sevens_job, trainer_logps  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
TOKEN = "s3cret"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.helpers import varied_tiny_model

    return varied_tiny_model(tmp_path_factory.mktemp("serve-model"))


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory):
    """One vLLM server for the module, started as ft train starts it (an adapter of rank 8 servable)."""
    spec = EngineSpec(model=str(model_dir), tokenizer=str(model_dir), dtype="fp32", max_model_len=512, lora_rank=8)
    port = free_port()
    log_path = tmp_path_factory.mktemp("serve-log") / "server.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            server_command(spec, "127.0.0.1", port, None, gpu=False),
            env=server_env({**os.environ, "OMP_NUM_THREADS": "1"}, TOKEN, gpu=False),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(Http(url, TOKEN, 60), 600, process)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=60)
        print(log_path.read_text()[-2000:])


def client(url):
    section = type("Section", (), {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 8})()
    return RemoteRollout(url, section, stop=[0], token=TOKEN)


def test_an_adapter_reaches_the_server_as_a_new_lora_with_the_trainers_log_probs(served, model_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    rollout = client(served)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    before = trainer_logps(base, SEQUENCES)
    assert largest_gap(rollout.score(SEQUENCES), before) < 1e-4
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0))
    for version in (1, 2):
        trainer = one_training_step(model)
        rollout.update(Weights(trainer, Runtime(), tmp_path / "rollout", version=version, adapter=True))
        after = trainer_logps(model, SEQUENCES)
        assert largest_gap(before, after) > 1e-2  # the step changed the policy
        assert largest_gap(rollout.score(SEQUENCES), after) < 1e-4
    models = Http(served, TOKEN, 30).call("/v1/models", method="GET")["data"]
    assert sorted(m["id"] for m in models) == ["ft-adapter-2", "ft-policy"]  # the previous adapter was dropped


def test_full_weights_are_reloaded_in_place_with_the_trainers_log_probs(served, model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    rollout = client(served)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    before = trainer_logps(model, SEQUENCES)
    for version in (3, 4):
        trainer = one_training_step(model)
        rollout.update(Weights(trainer, Runtime(), tmp_path / "rollout", version=version, adapter=False))
        after = trainer_logps(model, SEQUENCES)
        assert largest_gap(before, after) > 1e-2
        assert largest_gap(rollout.score(SEQUENCES), after) < 1e-4
    completions = rollout.generate([SEQUENCES[0][:4]] * 3, seed=7)
    assert all(len(c.ids) == len(c.logps) > 0 for c in completions)
    assert sorted(p.name for p in (tmp_path / "rollout").iterdir()) == ["weights-00000003", "weights-00000004"]


def metric(url, name: str) -> float:
    """A counter or gauge of vLLM's (its /metrics), summed over its labels."""
    text = Http(url, TOKEN, 30).call("/metrics", method="GET")
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"vllm:{name}"))


def test_requests_in_flight_keep_generating_across_a_full_weight_update(served, model_dir, tmp_path):
    """Asynchronous rollouts through a server: requests frozen mid-generation (vLLM's pause mode keep) while full
    weights are reloaded come back whole, each token's log-prob that of the old weights up to the update and of the new
    ones after it (no step ran with half-updated weights, no KV block of the old weights was read with the new ones)."""
    import copy
    from concurrent.futures import ThreadPoolExecutor

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    # long completions: on a CPU the engine takes about a millisecond a step for all 32, so the update lands
    # mid-generation of most of them on a quiet machine (31 of 32); beside the other tests the pause can arrive after
    # most have finished (2 of 32 once)
    section = type("Section", (), {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 480})()
    rollout = RemoteRollout(served, section, stop=[], token=TOKEN)
    rollout.update(Weights(one_training_step(model), Runtime(), tmp_path / "rollout", version=6, adapter=False))
    old = copy.deepcopy(model)
    prompts = [SEQUENCES[i % 2][: 3 + i % 4] for i in range(32)]
    with ThreadPoolExecutor(1) as pool:
        generated = metric(served, "generation_tokens_total")
        generating = pool.submit(rollout.generate, prompts, 11)
        while metric(served, "generation_tokens_total") < generated + 8 * len(prompts) and not generating.done():
            time.sleep(0.02)  # until the requests are into their completions
        Http(served, TOKEN, 30).call("/pause?mode=keep")  # frozen mid-generation; the update pauses and resumes
        trainer = one_training_step(model)
        rollout.update(Weights(trainer, Runtime(), tmp_path / "rollout", version=7, adapter=False))
        completions = generating.result()
    straddled = resumed = 0
    for prompt, c in zip(prompts, completions):
        assert len(c.ids) == len(c.logps) > 0  # none aborted (the client refuses a completion cut short)
        seq = prompt + c.ids
        before = trainer_logps(old, [seq])[0][len(prompt) - 1 :]
        after = trainer_logps(model, [seq])[0][len(prompt) - 1 :]
        versions = []  # of the tokens only one version explains: 0 the old weights, 1 the new ones
        for engine_lp, b, a in zip(c.logps, before, after):
            old_fits, new_fits = abs(engine_lp - b) < 1e-3, abs(engine_lp - a) < 1e-3
            assert old_fits or new_fits, (engine_lp, b, a)  # never a step with half-updated weights or stale KV
            if old_fits != new_fits:
                versions.append(int(new_fits))
        assert versions == sorted(versions), versions  # the old weights' tokens, then the new weights'
        straddled += 0 < sum(versions) < len(versions)
        resumed += sum(versions) > 0
    # frozen mid-generation, not restarted: of the requests that generated after the update, most hold tokens of both
    # weights (a request started again from its prompt would hold the new weights' only)
    assert straddled >= max(1, resumed // 2), (straddled, resumed)
    assert largest_gap(rollout.score(SEQUENCES), trainer_logps(model, SEQUENCES)) < 1e-4


KILL_HOOK = """
import json, os, signal
from pathlib import Path

def kill_server(rank, step):
    if step == int(os.environ["KILL_AT_STEP"]):
        server = json.loads((Path(os.environ["KILL_RUN"]) / "rollout-server.json").read_text())
        os.kill(server["pid"], signal.SIGKILL)
"""


def test_grpo_through_vllm_serve_learns_asynchronously_and_a_killed_server_ends_the_job_which_resumes(
    tmp_path, sft_model
):
    """The sevens task, 30 steps, asynchronous with two rollouts generated ahead (the server takes weights while it
    generates), the server ft train started killed before step 25: the job ends with the server named; --resume starts
    a new server and trains from the checkpoint of step 20 (and the two rollouts it kept) to the end; the mean reward
    of the last 10 steps is at least twice that of the first 10, and the lag is the schedule's."""
    steps, run = 30, tmp_path / "run"  # the last 10 all trained after the resume
    job = sevens_job(tmp_path, sft_model, steps)
    placed = [
        "--hardware",
        "cpu",
        "--set",
        "method.rollout.asynchronous=true",
        "--set",
        "method.rollout.max_staleness=2",
    ]
    hook = tmp_path / "kill.py"
    hook.write_text(KILL_HOOK)
    env = {"FT_STEP_HOOK": f"{hook}:kill_server", "KILL_AT_STEP": "25", "KILL_RUN": str(run)}
    r = ft_train(job, *placed, env=env, timeout=900)
    assert r.returncode != 0
    # killed with requests in flight, the server is gone, or its engine died first and it answered 500
    assert re.search(r"rollout server http://127\.0\.0\.1:\d+\S* (cannot be reached|answered 5\d\d)", r.stderr), (
        r.stderr[-3000:]
    )
    assert "--resume" in r.stderr and "Traceback" not in r.stderr
    assert not (run / "rollout-server.json").exists()
    r = ft_train(job, *placed, "--resume", timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    by_step = {g["step"]: g for g in rows(run)}  # the resumed steps replace the ones after the checkpoint
    assert sorted(by_step) == list(range(1, steps + 1))
    reward = [by_step[s]["reward"] for s in range(1, steps + 1)]
    first, last = sum(reward[:10]) / 10, sum(reward[-10:]) / 10
    assert last >= 2 * first, [round(x, 3) for x in reward]
    # the first rollout is generated on the spot, the next two ahead with the same weights, then two steps behind;
    # after the resume too (the checkpoint kept the two rollouts ahead, and their versions)
    assert [by_step[s]["rollout_lag"] for s in range(1, steps + 1)] == [0, 1] + [2] * (steps - 2)
    assert by_step[1]["logp_mismatch"] < 1e-3  # synced before generating
    assert all(by_step[s]["logp_mismatch"] > 1e-3 for s in (3, 21))  # two updates behind the trainer
    plan = json.loads((run / "plan.json").read_text())
    assert plan["rollout"]["placement"] == "server"
    url = re.findall(r"listening on (http://\S+)", (run / "rollout-server.log").read_text())[-1]
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(url + "/health", timeout=5)  # the resumed run's server was stopped with it
    assert not (run / "rollout-server.json").exists()
