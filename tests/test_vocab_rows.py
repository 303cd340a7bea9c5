"""The embeddings and the output head under FSDP2, sharded by vocabulary rows and gathered a chunk at a time
(finetune/distributed/vocab.py), against one unsharded process."""

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO, free_port


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("vocab")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1"]
    cmd += ["--master-port", str(free_port()), str(REPO / "tests" / "scripts" / "vocab_probe.py"), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads((out / "result.json").read_text())


CASES = [f"tied={t},frozen={f}" for t in (False, True) for f in (False, True)]


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_row_sharded_ends_give_the_one_process_logits_and_gradients(result, name):
    """An odd vocabulary (the last rank holds fewer rows) walked in 3 chunks per shard: every rank's logits and every
    parameter's gradient (the tables' own when they train) equal one process's over both ranks' batches."""
    case = result[name]
    assert case["ends"] == ["ShardedEmbedding", "ShardedHead"] and case["chunks"] > 1
    assert case["placements"] == ["(Shard(dim=0),)"]
    assert case["logits"] < 1e-5
    assert max(case["grads"].values()) < 1e-5
    trained = {n for n in case["grads"] if "embed_tokens" in n or "lm_head" in n}
    if "frozen=True" in name:
        assert not trained
    else:
        assert trained == (
            {"model.embed_tokens.weight"} if "tied=True" in name else {"model.embed_tokens.weight", "lm_head.weight"}
        )


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_row_sharded_ends_train_gather_whole_for_generation_and_save_whole(result, name):
    case = result[name]
    assert case["losses"][-1] < case["losses"][0] - 0.3
    assert case["whole_vs_chunked"] < 1e-5  # fsdp.unsharded (generate()) gathers each table once: the same logits
    assert case["state_shapes"]["lm_head.weight"] == [301, 32] and case["state_shapes"][
        "model.embed_tokens.weight"
    ] == [301, 32]


@pytest.mark.slow
def test_gemma_scaled_embeddings_are_row_sharded_with_their_scale(result):
    """Gemma3's ScaledWordEmbedding (rows times sqrt(hidden)), tied to the head: sharded by rows under a class that is
    still a Gemma3TextScaledWordEmbedding, with the one-process logits and gradients."""
    case = result["gemma3"]
    assert case["ends"] == ["ShardedGemma3TextScaledWordEmbedding", "ShardedHead"]
    assert case["logits"] < 1e-5 and max(case["grads"].values()) < 1e-5
    assert "model.embed_tokens.weight" in case["grads"]
