"""What the probes share (imported from the probe scripts' own folder)."""

RUN = "run="  # a probe argument naming a run folder to train (train_run_folders)


def peak_rss() -> int:
    """This process's peak resident set size in bytes (file-backed pages included)."""
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def train_run_folders(specs: list[str]) -> None:
    """Each run folder in turn, trained on this rank as `python -m finetune.rank RUN_DIR [--resume-from CHECKPOINT]`
    trains it, all in the one torchrun launch of the probe (each launch costs its ranks' imports). A spec is
    `run=RUN_DIR`, or `run=RUN_DIR@resume=CHECKPOINT`: the run folder holding CHECKPOINT (trained by an earlier spec)
    is first copied to RUN_DIR as it was after its run (final/ left out), and RUN_DIR resumes from its copy of
    CHECKPOINT: the uninterrupted run's folder stays as it was for the test to read."""
    import shutil
    from pathlib import Path

    import torch.distributed as dist

    from finetune.rank import train_run_folder

    for spec in specs:
        run_dir, _, resume = spec.removeprefix(RUN).partition("@resume=")
        run_dir, resume_from = Path(run_dir), None
        if resume:
            checkpoint = Path(resume)
            if not dist.is_initialized() or dist.get_rank() == 0:
                shutil.copytree(checkpoint.parent.parent, run_dir, ignore=shutil.ignore_patterns("final"))
            if dist.is_initialized():
                dist.barrier()
            resume_from = run_dir / checkpoint.parent.name / checkpoint.name
        train_run_folder(run_dir, resume_from)
        if dist.is_initialized():
            dist.barrier()
