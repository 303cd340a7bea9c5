"""Multi-process training on CPU (gloo, loopback): DDP against one process, disjoint data, failures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from finetune.data.stream import Stream
from tests.helpers import LORA, REPO, free_port, ft_here, job, launch_here, losses, step_hook


@pytest.mark.parametrize("world", [1, 2, 4])
def test_ranks_see_disjoint_rows_whose_union_is_the_epoch(world):
    rows, batch = 48, 8
    seen = []
    for rank in range(world):
        s = Stream(rows, batch, seed=3, rank=rank, world=world)
        seen.append([i for _ in range(rows // batch) for i in s.next_step()])
    flat = [i for r in seen for i in r]
    assert sorted(flat) == list(range(rows))  # disjoint, and together one epoch
    single = Stream(rows, batch, seed=3)
    assert sorted(flat) == sorted(i for _ in range(rows // batch) for i in single.next_step())


@pytest.mark.slow
def test_two_process_ddp_matches_one_process_with_twice_the_accumulation(tmp_path, one_process, capfd):
    launch_here(job(tmp_path, "two"))  # ft train --hardware cpu:2, this process the launcher
    said = capfd.readouterr().err
    assert "torch.distributed.run" in said and "--nproc-per-node=2" in said
    p1, p2 = (json.loads((run / "plan.json").read_text()) for run in (one_process, tmp_path / "two"))
    assert (
        p1["backend"],
        p1["gradient_accumulation_steps"],
        p2["backend"],
        p2["world_size"],
        p2["gradient_accumulation_steps"],
    ) == ("single", 2, "ddp", 2, 1)
    a, b = losses(one_process), losses(tmp_path / "two")
    assert len(a) == len(b) == 6 and a[-1] < a[0]
    assert a == pytest.approx(b, rel=1e-4, abs=1e-5)
    ranks_start_from_the_run_folder_alone(tmp_path, tmp_path / "two", b, capfd)


def ranks_start_from_the_run_folder_alone(tmp_path, run, first: list[float], capfd) -> None:
    """launch.txt is what ran; ft plan of the saved config gives the saved plan; the same ranks started by hand from
    the folder reproduce the losses, without importing the CLI or calling the planner, the probe or the resolver."""
    launch = (run / "launch.txt").read_text()
    assert (
        "torch.distributed.run" in launch
        and "-m finetune.rank" in launch
        and str(run) in launch
        and "--nproc-per-node=2" in launch
    )
    code, out, err = ft_here(capfd, "plan", str(run / "config.yaml"), "--hardware", "cpu:2", "--json")
    assert code == 0, err
    assert json.loads(out) == json.loads((run / "plan.json").read_text())
    (run / "metrics.jsonl").unlink()
    ranks = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=1",
            "--nproc-per-node=2",
            f"--master-port={free_port()}",
            str(REPO / "tests" / "scripts" / "rank_imports.py"),
            str(run),
            str(tmp_path / "mods"),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    assert ranks.returncode == 0, ranks.stderr[-3000:]
    assert losses(run) == pytest.approx(first, rel=1e-6)
    for rank in (0, 1):
        modules = set(json.loads((tmp_path / f"mods-{rank}.json").read_text())["modules"])
        assert "finetune.rank" in modules and not {"finetune.cli", "finetune.workflow"} & modules  # no launcher code


@pytest.mark.slow
def test_a_failing_rank_ends_the_job_with_its_error(tmp_path, capfd):
    start = time.time()
    fail = step_hook(tmp_path, fail=(1, 3))
    code, out, err = ft_here(
        capfd, "train", job(tmp_path, "fail", steps=50), "--hardware", "cpu:2", env=fail, timeout=240
    )
    assert code != 0
    assert "injected failure on rank 1 at step 3" in err + out
    assert "a rank exited with code" in err
    assert time.time() - start < 240


@pytest.mark.slow
def test_two_nodes_on_loopback_train_together(tmp_path, one_process, capfd):
    config, port = job(tmp_path, "nodes"), str(free_port())

    def node(r: int) -> list[str]:
        return ["train", config, "--hardware", "2x1xcpu", "--nnodes", "2", "--node-rank", str(r)] + [
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            port,
        ]

    # node 1 in a process of its own (to files: a full pipe would stall it while node 0 runs), node 0 in this one
    with open(tmp_path / "node1.out", "w") as out, open(tmp_path / "node1.err", "w") as err:
        other = subprocess.Popen(
            [sys.executable, "-m", "finetune", *node(1)],
            cwd=REPO,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stdout=out,
            stderr=err,
            text=True,
        )
    try:
        code, _, err0 = ft_here(capfd, *node(0))
        other.wait(timeout=300)
    finally:
        if other.poll() is None:
            other.kill()
    err1 = (tmp_path / "node1.err").read_text()
    assert [code, other.returncode] == [0, 0], err0[-2000:] + err1[-2000:]
    assert "--node-rank=1" in err1 and "--master-addr=127.0.0.1" in err0
    assert all("gloo (ft's own collectives between nodes) uses lo" in err for err in (err0, err1))  # launch/netif.py
    plan = json.loads((tmp_path / "nodes" / "plan.json").read_text())
    assert (plan["nodes"], plan["world_size"], plan["backend"]) == (2, 2, "ddp")
    assert losses(tmp_path / "nodes") == pytest.approx(losses(one_process), rel=1e-4, abs=1e-5)


@pytest.mark.slow
def test_fsdp_matches_one_process_and_resumes_after_a_stop(tmp_path, one_process, capfd):
    fsdp = job(tmp_path, "fsdp")
    sharded = [
        "--hardware",
        "cpu:2",
        "--set",
        "distributed.backend=fsdp",
        "--set",
        "distributed.sharding=full_shard",
        "--set",
        "output.save_steps=3",
        "--set",  # the head runs outside the forward, on the root unit gathered again: still one process's losses
        "train.loss_implementation=chunked",
        "--set",  # each layer's recomputed forward gathers its inner units (fsdp.pieces) again
        "train.gradient_checkpointing=true",
    ]
    code, _, stderr = ft_here(capfd, "train", fsdp, *sharded, env=step_hook(tmp_path, stop_at=4))
    assert code == 143, stderr[-3000:]
    assert "Resume with: ft train CONFIG --resume" in stderr
    ckpt = tmp_path / "fsdp" / "checkpoints" / "step-00000004"
    assert (ckpt / "dcp").is_dir() and (ckpt / "rng-1.pt").exists()  # sharded: every rank wrote its part
    assert json.loads((ckpt / "state.json").read_text())["format"] == "dcp"  # the engine's format, recorded
    launch_here(fsdp, *sharded[2:], resume=True)  # ft train ... --resume, this process the launcher
    plan = json.loads((tmp_path / "fsdp" / "plan.json").read_text())
    assert (plan["backend"], plan["sharding"], plan["world_size"]) == ("fsdp", "full_shard", 2)
    assert plan["loss_implementation"] == "chunked" and plan["gradient_checkpointing"]
    assert losses(tmp_path / "fsdp") == pytest.approx(losses(one_process), rel=1e-4, abs=1e-5)
    from transformers import AutoModelForCausalLM

    a = AutoModelForCausalLM.from_pretrained(str(one_process / "final"))
    b = AutoModelForCausalLM.from_pretrained(str(tmp_path / "fsdp" / "final"))  # gathered from the shards

    assert max((pa - pb).abs().max().item() for pa, pb in zip(a.parameters(), b.parameters())) < 1e-4
    from finetune.consolidate import consolidate

    c1 = AutoModelForCausalLM.from_pretrained(str(consolidate(one_process, step=3, out=tmp_path / "c1")))
    # DCP shards of 2 ranks, read by one process
    c2 = AutoModelForCausalLM.from_pretrained(str(consolidate(tmp_path / "fsdp", step=3)))
    assert max((pa - pb).abs().max().item() for pa, pb in zip(c1.parameters(), c2.parameters())) < 1e-4
    assert max((pa - pb).abs().max().item() for pa, pb in zip(c1.parameters(), a.parameters())) > 1e-3


@pytest.mark.slow
def test_lora_adapter_saved_from_fsdp_reloads_with_the_right_weights(tmp_path, one_process_lora):
    import torch
    from safetensors.torch import load_file

    launch_here(job(tmp_path, "fsdp"), "--set", "distributed.backend=fsdp", *LORA)  # ft train --hardware cpu:2
    a = load_file(str(one_process_lora / "final" / "adapter_model.safetensors"))
    b = load_file(str(tmp_path / "fsdp" / "final" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() and len(a) > 0
    for k in a:
        # not the empty or mis-shaped tensors of a bad sharded save
        assert a[k].shape == b[k].shape and a[k].numel() > 0
        torch.testing.assert_close(a[k], b[k], atol=1e-4, rtol=1e-3)
    assert any(v.abs().sum() > 0 for k, v in b.items() if "lora_B" in k)


@pytest.mark.slow
def test_a_rank_that_stops_responding_times_out_with_a_message_naming_rank_and_activity(tmp_path, capfd):
    start = time.time()
    code, stdout, stderr = ft_here(
        capfd,
        "train",
        job(tmp_path, "hang", steps=20),
        "--hardware",
        "cpu:2",
        "--set",
        "distributed.timeout_minutes=0.1",
        env=step_hook(tmp_path, hang=(1, 3, 9)),
        timeout=240,
    )
    out = " ".join((stderr + stdout).split())  # messages are wrapped to the terminal's width
    assert code == 134, out[-3000:]  # retryable: a scheduler restarts the job, which resumes
    assert (
        "rank 0 waited 0.1 min for the other ranks during step 3 of 20: summing the step's trained tokens over ranks"
        in out
    ), out[-3000:]
    assert time.time() - start < 90  # the timeout ended it, not the test's own limit


@pytest.mark.slow
def test_fsdp_on_one_process_runs_under_torchrun_and_matches_a_plain_process(tmp_path, one_process, capfd):
    """What the planner picks for one GPU that only fits with FSDP offload: FSDP2 needs a process group even of one."""
    launch_here(job(tmp_path, "fsdp"), "--set", "distributed.backend=fsdp", hardware="cpu")  # this process launches
    assert "--nproc-per-node=1" in capfd.readouterr().err
    assert losses(tmp_path / "fsdp") == pytest.approx(losses(one_process), rel=1e-4, abs=1e-5)
