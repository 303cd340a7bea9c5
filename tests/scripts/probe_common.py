"""What the loading probes share (imported from the probe scripts' own folder)."""


def peak_rss() -> int:
    """This process's peak resident set size in bytes (file-backed pages included)."""
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")
