"""`ft generate` / `ft eval` across nodes: two loopback "nodes" (one `ft generate` each, run concurrently) write the
same bytes as one process; a node that dies fails the other at once, and the job resumes; refusals; Slurm script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from finetune.artifacts import resolve
from finetune.errors import FtError
from finetune.infer import nodes
from finetune.infer.engines import Sampling
from finetune.infer.generate import generate
from finetune.infer.job import GenerateJob
from finetune.infer.prompts import PromptSpec
from finetune.workflow import NodeRole
from tests.helpers import REPO, crash_hook, free_port

MAX_NEW, BATCH, PROMPTS = 4, 2, 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from finetune.tiny import build_model

    folder = tmp_path_factory.mktemp("tiny-model")
    build_model(folder)
    return folder


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    """Chat prompts of varied lengths with ids and their answers (for ft eval)."""
    from finetune.tiny import arithmetic_records, write_jsonl

    records = [
        {"id": f"q{i:02d}", "messages": r["messages"], "answer": r["messages"][1]["content"]}
        for i, r in enumerate(arithmetic_records(PROMPTS, seed=5))
    ]
    for i, r in enumerate(records):
        r["messages"] = [{"role": "user", "content": r["messages"][0]["content"] + " now" * (i % 4)}]
    return write_jsonl(records, tmp_path_factory.mktemp("prompts") / "prompts.jsonl")


def gen_job(model_dir, prompts_file, out) -> GenerateJob:
    return GenerateJob(
        resolve(str(model_dir)), PromptSpec(str(prompts_file)), str(out), Sampling(max_new_tokens=MAX_NEW), batch_size=2
    )


@pytest.fixture(scope="module")
def one_process(model_dir, prompts_file, tmp_path_factory):
    """The reference: one process, in this test process."""
    out = tmp_path_factory.mktemp("one") / "out.jsonl"
    generate(gen_job(model_dir, prompts_file, out), processes=1, progress=False)
    return out


def on_two_nodes(args: list[str], env: dict | None = None, timeout: int = 240) -> list[subprocess.CompletedProcess]:
    """`python -m finetune ARGS --nnodes 2 --node-rank R --master-addr 127.0.0.1 --master-port P` for R = 0 and 1,
    run concurrently (one process per node), each with its own output."""
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "finetune", *args, "--nnodes", "2", "--node-rank", str(rank)]
            + ["--master-addr", "127.0.0.1", "--master-port", port],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        )
        for rank in (0, 1)
    ]
    done = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        done.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return done


def generate_args(model_dir, prompts_file, out) -> list[str]:
    return [
        "generate",
        str(model_dir),
        "--prompts",
        str(prompts_file),
        "--out",
        str(out),
        "--max-new-tokens",
        str(MAX_NEW),
        "--batch-size",
        str(BATCH),
        "--quiet",
    ]


# ---------------------------------------------------------------- what each node runs, refusals
def test_each_node_starts_its_ranks_of_one_torchrun_job_and_only_node_0_knows_the_attempt():
    zero, one = NodeRole(2, 0, "10.0.0.1", 29600), NodeRole(2, 1, "10.0.0.1", 29600)
    cmd0 = nodes.worker_command("o.parts", 3, zero, 4, 8)
    cmd1 = nodes.worker_command("o.parts", None, one, 4, 8)
    assert "--nnodes=2" in cmd0 and "--nproc-per-node=4" in cmd0 and "--node-rank=0" in cmd0
    assert "--master-addr=10.0.0.1" in cmd1 and "--master-port=29600" in cmd1 and "--node-rank=1" in cmd1
    assert cmd0[-6:] == ["o.parts", "3", "--nodes", "2", "--gpus", "8"] and cmd1[-5] == "-"
    assert "--rdzv-conf=timeout=1800" in cmd1  # node 1 may wait long for node 0, which tokenizes every prompt first
    c10d = nodes.worker_command("o.parts", None, NodeRole(2, 1, "head", 29600, "job-7"), 4, 8)
    assert "--rdzv-backend=c10d" in c10d and "--rdzv-endpoint=head:29600" in c10d
    assert not nodes.spans_nodes(None) and not nodes.spans_nodes(NodeRole(1)) and nodes.spans_nodes(zero)


@pytest.mark.parametrize(
    "role, message",
    [
        (NodeRole(2, 2, "127.0.0.1"), "--node-rank 2 with --nnodes 2: a node's rank is 0 .. 1"),
        (NodeRole(2, 0, None), "generation across 2 nodes needs the address of node 0"),
    ],
)
def test_a_node_without_its_rank_or_node_0s_address_is_refused(model_dir, prompts_file, tmp_path, role, message):
    with pytest.raises(FtError, match=message):
        generate(gen_job(model_dir, prompts_file, tmp_path / "o.jsonl"), role=role, progress=False)
    assert not (tmp_path / "o.jsonl.parts").exists()


def test_eval_across_nodes_needs_a_shared_predictions_file(model_dir, prompts_file):
    from finetune.infer.evaluation import EvalJob, evaluate
    from finetune.infer.scoring import parse

    job = EvalJob(resolve(str(model_dir)), PromptSpec(str(prompts_file)), (parse("exact_match", None),))
    with pytest.raises(FtError, match="--predictions with a path on the filesystem all nodes share"):
        evaluate(job, role=NodeRole(2, 1, "127.0.0.1"))
    with pytest.raises(FtError, match="loss and lm-eval tasks run in one process"):
        evaluate(EvalJob(job.source, job.data, (), loss=True), role=NodeRole(2, 0, "127.0.0.1"))


@pytest.mark.slow
def test_the_ranks_share_node_0s_attempt_and_wait_for_each_other(monkeypatch):
    """Two ranks in threads, through a store like torchrun's: the rank that planned publishes the attempt, the other
    reads it; a rank that never finishes makes the other's wait end in an error saying so, and one that goes away
    (its connections close, as when its process dies) ends it at once."""
    import time

    import torch.distributed as dist

    def group_of_two(second: str):
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(store.port))
        seen: dict = {}
        first_done = threading.Event()

        def first() -> None:
            group = nodes.NodeGroup(0, 2)
            seen[0] = group.attempt(5)
            start = time.monotonic()
            try:
                group.finish({"finishes": 30, "hangs": 2}.get(second, 20))
                seen["finished"] = True
            except FtError as e:
                seen["finished"] = str(e)
            seen["waited"] = time.monotonic() - start
            first_done.set()

        def other() -> None:
            group = nodes.NodeGroup(1, 2)
            seen[1] = group.attempt(None)
            if second == "finishes":
                group.finish(30)
            elif second == "hangs":
                first_done.wait(60)
            del group  # "goes away": its connections close

        threads = [threading.Thread(target=first), threading.Thread(target=other)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        return seen

    assert {k: v for k, v in group_of_two("finishes").items() if k != "waited"} == {0: 5, 1: 5, "finished": True}
    hung = group_of_two("hangs")
    assert hung[1] == 5 and "process 0 of 2: the other processes have not finished" in hung["finished"]
    gone = group_of_two("goes away")
    assert "another process stopped before finishing its share" in gone["finished"] and gone["waited"] < 10


def test_ft_launch_generate_on_two_nodes_runs_ft_generate_on_each_with_its_node_rank(tmp_path):
    from finetune.workflow import write_generate_script

    args = ["runs/x", "--prompts", "p.jsonl", "--out", str(tmp_path / "o.jsonl")]
    two = write_generate_script(args, str(tmp_path / "o.jsonl"), "2x8xH100", tmp_path / "two.sbatch", "1:00:00", None)
    text = two.read_text()
    assert "#SBATCH --nodes=2" in text and "#SBATCH --gpus-per-node=8" in text
    assert '--nnodes "${SLURM_NNODES:-2}" --node-rank "${SLURM_NODEID:-$SLURM_PROCID}"' in text
    assert '--master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"' in text
    one = write_generate_script(args, str(tmp_path / "o.jsonl"), "8xH100", tmp_path / "one.sbatch", "1:00:00", None)
    assert "#SBATCH --nodes=1" in one.read_text() and "--nnodes" not in one.read_text()


# ---------------------------------------------------------------- two loopback nodes
@pytest.mark.slow
def test_two_nodes_write_the_same_bytes_as_one_process(one_process, model_dir, prompts_file, tmp_path):
    out = tmp_path / "two.jsonl"
    node0, node1 = on_two_nodes(generate_args(model_dir, prompts_file, out))
    assert node0.returncode == 0 and node1.returncode == 0, node0.stderr[-3000:] + node1.stderr[-3000:]
    assert f"{PROMPTS} rows ({PROMPTS} generated now)" in node0.stderr and "on 2 processes over 2 nodes" in node0.stderr
    assert "--node-rank=1" in node1.stderr and "node 1 of 2: its share is done (1 process)" in node1.stderr
    assert out.read_bytes() == one_process.read_bytes()
    assert not out.with_name("two.jsonl.parts").exists()


@pytest.mark.slow
def test_ft_eval_on_two_nodes_when_a_node_dies_fails_the_other_and_resumes(
    one_process, model_dir, prompts_file, tmp_path
):
    from finetune.infer.evaluation import EvalJob, evaluate
    from finetune.infer.scoring import parse

    predictions = tmp_path / "predictions.jsonl"
    parts = predictions.with_name("predictions.jsonl.parts")
    args = ["eval", str(model_dir), "--data", str(prompts_file), "--metric", "exact_match"]
    args += ["--predictions", str(predictions), "--max-new-tokens", str(MAX_NEW), "--batch-size", str(BATCH), "-q"]
    # rank 1 (node 1) dies after its first batch, leaving half a line; rank 0 (node 0) is told at its barrier
    hook = crash_hook(tmp_path, parts, rank=1, batches=1)
    node0, node1 = on_two_nodes(args, env={"FT_BATCH_HOOK": hook})
    assert node1.returncode != 0 and node0.returncode != 0
    assert "another process stopped before finishing its share" in node0.stderr, node0.stderr[-3000:]
    assert "generation failed" in node0.stderr and not predictions.exists()
    written = [json.loads(line)["id"] for line in (parts / "part-1-r1.jsonl").read_text().splitlines()[:-1]]
    assert len(written) == BATCH and (parts / "launch.txt").read_text().startswith("# node 0 of 2")
    job = EvalJob(
        resolve(str(model_dir)),
        PromptSpec(str(prompts_file)),
        (parse("exact_match", None),),
        max_new_tokens=MAX_NEW,
        batch_size=BATCH,
        predictions=str(predictions),
    )
    resumed = evaluate(job, processes=1, progress=False)  # here, on one node: it continues the job of two
    assert BATCH <= PROMPTS - resumed.generation["generated"] < PROMPTS
    assert predictions.read_bytes() == one_process.read_bytes() and not parts.exists()
    rows = [json.loads(line) for line in one_process.read_text().splitlines()]
    right = sum(r["completion"].strip() == r["answer"] for r in rows) / PROMPTS
    assert resumed.metrics["exact_match"] == pytest.approx(right)
