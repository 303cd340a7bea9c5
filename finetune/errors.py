"""Errors shown to users. The CLI prints them without a traceback and exits with their exit code."""

from __future__ import annotations

from dataclasses import dataclass, field

Path = tuple  # a key path into the config: ("data", "datasets", 0, "format")


def dotted(path: Path) -> str:
    """("data", "datasets", 0, "format") -> "data.datasets[0].format"."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


class FtError(Exception):
    """An error the user can fix; `str()` is the whole message. Exit code 2: the input was wrong."""

    exit_code = 2


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a job file: which keys, what is wrong, how to fix it."""

    keys: tuple[Path, ...]
    message: str
    fix: str = ""
    where: tuple[str, ...] = field(default=())  # one location per key: "cfg.yaml:12" or "--set a.b=c"

    def render(self) -> str:
        names = []
        for i, key in enumerate(self.keys):
            loc = self.where[i] if i < len(self.where) and self.where[i] else ""
            names.append(f"{dotted(key) or '(top level)'}" + (f" ({loc})" if loc else ""))
        head = " conflicts with ".join(names) if len(names) > 1 else (names[0] if names else "")
        if not self.keys and self.where:
            head = self.where[0]
        text = f"{head}: {self.message}" if head else self.message
        return text + (f"\n    fix: {self.fix}" if self.fix else "")


class ConfigError(FtError):
    """Every problem found in a job file, reported together."""

    exit_code = 2

    def __init__(self, source: str, problems: list[Problem]):
        self.source = source
        self.problems = list(problems)
        n = len(self.problems)
        lines = [f"{source}: {n} problem{'s' if n != 1 else ''}"]
        lines += [f"  ✗ {p.render()}".replace("\n", "\n  ") for p in self.problems]
        super().__init__("\n".join(lines))


class PlanError(FtError):
    """The job cannot run on this hardware as asked; the message gives the estimate and options that fit."""

    exit_code = 2


class HardwareError(FtError):
    """A hardware description that cannot be read."""

    exit_code = 2


class DataError(FtError):
    """Data that cannot be read or turned into training examples; the message names the file/line or sample."""

    exit_code = 2
