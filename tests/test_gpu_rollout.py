"""GRPO's vLLM rollout engine on GPUs: what CPU tests cannot show (scripts/gpu-check.sh runs these, section rollout).

- A colocated engine in sleep mode gives its memory back between rollouts and, woken, samples as before and takes
  new weights; at level 2 (full fine-tuning, new weights before the next rollout) it drops its weights and takes all
  of them again (sleep mode is a no-op on CPU).
- Full weights reach vLLM's own server (`vllm serve --weight-transfer-config '{"backend": "nccl"}'`, started as ft
  train starts it) over NCCL (vLLM's weight-transfer engine and routes) and its log-probs then equal the trainer's.
  NCCL refuses two ranks on one GPU, so this needs two: the trainer on GPU 0, the server on GPU 1.
- `placement: ray` on a one-node Ray cluster of two GPUs (where Ray is installed): the rank's actor and the server's
  get GPUs of their own (Ray's CUDA_VISIBLE_DEVICES, passed on to the rank and to `vllm serve`), and the weights reach
  the server over NCCL at rank 0's node address.
"""

from __future__ import annotations

import os
import subprocess

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
vllm = pytest.importorskip("vllm")

from finetune.distributed.runtime import Runtime  # noqa: E402
from finetune.rollout.vllm import EngineSpec, VllmRollout, prepare_environment  # noqa: E402
from finetune.rollout.weights import Weights  # noqa: E402
from tests.rollout_helpers import SEQUENCES  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.helpers import varied_tiny_model

    return varied_tiny_model(tmp_path_factory.mktemp("gpu-rollout-model"))


def trained(model_dir, device):
    """The model on `device` after one AdamW step, inside ft's engine."""
    from transformers import AutoModelForCausalLM

    from finetune.distributed.engine import TorchEngine

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    engine = TorchEngine(model, optimizer, scheduler, 1.0, False, torch.device(device))
    ids = torch.tensor(SEQUENCES[:1], device=device)
    model(input_ids=ids, labels=ids).loss.backward()
    engine.step()
    return model, engine


def trainer_logps(model, sequences):
    with torch.no_grad():
        out = []
        for seq in sequences:
            logps = model(torch.tensor([seq], device=model.device)).logits[0].float().log_softmax(-1)
            out.append([logps[i - 1, t].item() for i, t in enumerate(seq) if i > 0])
    return out


def gap(a, b) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def test_a_sleeping_colocated_engine_frees_its_memory_and_wakes_with_new_weights(model_dir):
    prepare_environment(gpu=True)
    spec = EngineSpec(
        model=str(model_dir), tokenizer=str(model_dir), dtype="fp32", max_model_len=128, memory_share=0.3, sleep=True
    )
    engine = VllmRollout(spec, stop=[0])
    before = engine.sample([s[:4] for s in SEQUENCES], 0, 0.0, 1.0, 8, [0])
    free_awake = torch.cuda.mem_get_info()[0]
    engine.sleep()
    free_asleep = torch.cuda.mem_get_info()[0]
    total = torch.cuda.mem_get_info()[1]
    assert free_asleep - free_awake > 0.2 * total  # most of its 30% share (KV cache and weights) is given back
    again = engine.sample([s[:4] for s in SEQUENCES], 0, 0.0, 1.0, 8, [0])  # wakes itself
    assert [c.ids for c in again] == [c.ids for c in before]
    model, trainer = trained(model_dir, "cuda")
    engine.sleep()
    engine.update(Weights(trainer, Runtime(), ".", version=1, adapter=False))  # wakes, loads in place
    assert gap(engine.score(SEQUENCES), trainer_logps(model, SEQUENCES)) < 1e-3
    # full fine-tuning whose next rollout gets new weights: level 2 drops the weights instead of copying them to host
    free_awake = torch.cuda.mem_get_info()[0]
    engine.sleep(reloading=True)
    assert engine.sleep_level == 2 and torch.cuda.mem_get_info()[0] - free_awake > 0.2 * total
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.01)
    engine.update(Weights(trainer, Runtime(), ".", version=2, adapter=False))  # wakes, every weight loaded again
    assert gap(engine.score(SEQUENCES), trainer_logps(model, SEQUENCES)) < 1e-3
    engine.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs the trainer and the server on two GPUs")
def test_full_weights_reach_a_rollout_server_over_nccl(model_dir, tmp_path):
    from finetune.rollout.nccl import weight_source
    from finetune.rollout.serve import server_command, server_env
    from finetune.rollout.server import RemoteRollout

    spec = EngineSpec(model=str(model_dir), tokenizer=str(model_dir), dtype="fp32", max_model_len=128, memory_share=0.3)
    port = 18000 + os.getpid() % 1000
    env = {**server_env(os.environ, "t0ken", gpu=True), "CUDA_VISIBLE_DEVICES": "1"}
    log = open(tmp_path / "server.log", "wb")  # noqa: SIM115
    command = server_command(spec, "127.0.0.1", port, None, gpu=True)
    server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        os.environ["FT_ROLLOUT_NCCL_ADDR"] = "127.0.0.1"
        client = RemoteRollout(f"http://127.0.0.1:{port}", None, [0], token="t0ken")
        model, trainer = trained(model_dir, "cuda:0")
        client.update(Weights(trainer, Runtime(), tmp_path, version=1, adapter=False))
        assert client.nccl is not None  # it went over NCCL, not HTTP
        assert gap(client.score(SEQUENCES), trainer_logps(model, SEQUENCES)) < 1e-3
        model2, trainer2 = trained(model_dir, "cuda:0")  # a second update on the same transfer group
        with torch.no_grad():
            for p in model2.parameters():
                p.mul_(1.01)
        client.nccl.transfer.source = weight_source(trainer2)  # the same group, another trainer's parameters
        client.nccl.send()
        assert gap(client.score(SEQUENCES), trainer_logps(model2, SEQUENCES)) < 1e-3
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()
        print((tmp_path / "server.log").read_text()[-3000:])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="placement: ray needs a GPU to train and one to generate")
def test_grpo_on_ray_gives_the_rank_and_the_server_gpus_of_their_own(tmp_path, sft_model):
    pytest.importorskip("ray")
    import re

    from ray.cluster_utils import Cluster

    from tests.helpers import ft_train
    from tests.rollout_helpers import rows, sevens_job

    job = sevens_job(tmp_path, sft_model, 3)
    text = open(job).read().replace("placement: server", "placement: ray")
    open(job, "w").write(text)
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 4, "num_gpus": 2, "include_dashboard": False})
    try:
        r = ft_train(job, env={"RAY_ADDRESS": nodes.address, "CUDA_VISIBLE_DEVICES": "0,1"}, timeout=900)
    finally:
        nodes.shutdown()
    assert r.returncode == 0, r.stderr[-3000:]
    gpus = re.search(r"Ray GPUs \(as each node numbers them\): rank 0 = (\d+); vLLM server 0 = ([\d,]+)", r.stderr)
    assert gpus and gpus.group(1) not in gpus.group(2).split(","), r.stderr[-3000:]
    steps = rows(tmp_path / "run")
    assert [g["step"] for g in steps] == [1, 2, 3]
    assert all(g["sync_s"] > 0 and g["logp_mismatch"] < 0.1 for g in steps), steps  # the weights went over NCCL
