"""The command that starts a job's processes: one Python process, or torchrun across devices and nodes."""

from __future__ import annotations

DEFAULT_PORT = 29500


def launch_command(config_path: str, nodes: int, processes_per_node: int, master_addr: str | None = None, master_port: int = DEFAULT_PORT,
                   backend: str = "single") -> list[str]:
    """argv that runs `config_path` on nodes x processes_per_node ranks.

    One process runs ft's training entry point directly (FSDP2 and DeepSpeed still go through torchrun: they
    need a process group, even of one). Several processes on one node use
    torchrun's standalone rendezvous; several nodes need the same command on every node, with that
    node's rank and the address of node 0 (placeholders `$NODE_RANK` / `$MASTER_ADDR` when unknown).
    """
    worker = ["-m", "finetune.train", config_path]
    if nodes * processes_per_node == 1 and backend not in ("fsdp", "deepspeed"):
        return ["python", *worker]
    cmd = ["torchrun", f"--nnodes={nodes}", f"--nproc-per-node={processes_per_node}"]
    if nodes == 1:
        cmd.append("--standalone")
    else:
        cmd += ["--node-rank=$NODE_RANK", f"--master-addr={master_addr or '$MASTER_ADDR'}", f"--master-port={master_port}"]
    return cmd + worker
