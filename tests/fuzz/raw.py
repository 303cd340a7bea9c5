"""Mutations below the level of keys and values: raw bytes, YAML syntax, tags, aliases, `${VAR}`, `--set`.

Each function takes the `configs.Builder` of one seed file and adds its cases to it.
"""

from __future__ import annotations

import re

NON_PRINTABLE = re.compile("[^\x09\x0a\x0d\x20-\x7e\x85\xa0-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
ANY_LINE = r"{file}:\d+"
INT_PATHS = [
    ("train", "max_steps"),
    ("train", "warmup_steps"),
    ("train", "global_batch_size"),
    ("adapter", "r"),
    ("data", "seq_len"),
]
FLOAT_PATHS = [("train", "lr"), ("adapter", "alpha"), ("train", "weight_decay"), ("distributed", "timeout_minutes")]
TAGS = [
    "!!python/object/apply:os.system ['echo hacked']",
    "!!python/name:os.system",
    "!!python/object:finetune.config.schema.Config {}",
    "!!python/tuple [1, 2]",
    "!custom value",
    "!!binary aGVsbG8=",
    "!!set {a, b}",
    "!!omap [{a: 1}]",
    "!<tag:evil.example,2000:x> v",
    "!!python/object/new:dict {}",
]


def first_bad_line(body: bytes) -> int:
    """The line of the first byte that is not UTF-8, or else of the first character YAML does not allow."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        return body[: e.start].count(b"\n") + 1
    m = NON_PRINTABLE.search(text)
    return text[: m.start()].count("\n") + 1 if m else 1


def line_of(body: bytes, needle: str) -> int:
    return body[: body.index(needle.encode())].count(b"\n") + 1


def _key(path: tuple) -> str:
    from tests.fuzz.configs import key_re

    return key_re(path)


def huge_numbers(b) -> None:
    """Integers and floats with thousands of digits, and floats that overflow to infinity."""
    r = b.rng
    for path in r.sample(INT_PATHS, 2):
        b.raw_value(
            path,
            r.choice(["9" * 100_000, "1" * 5000, "-" + "7" * 20_000, "0x" + "f" * 50_000, "1_0" * 3000]),
            "huge-int",
        )
    for path in r.sample(FLOAT_PATHS, 2):
        b.raw_value(
            path, r.choice(["1.0e+99999", "-" + "9" * 100_000 + ".5", "0." + "0" * 50_000 + "1e+400"]), "huge-float"
        )


def _insert_line(text: str, line: int, new: str) -> str:
    lines = text.split("\n")
    lines.insert(line - 1, new)
    return "\n".join(lines)


def broken(b) -> None:
    """YAML that does not parse, or is not one mapping, or is too big."""
    r, text = b.rng, b.text
    n = text.count("\n") + 1
    breakers = [
        "key: 'unclosed",
        "\tkey: tab",
        "x: [1, 2",
        "- : : [",
        "@reserved: 1",
        "x: {a: 1",
        "  bad:\n indent: 2",
        'x: "bad \\q escape"',
        "x: *undefined_alias",
        "? [complex, key]\n: value",
    ]
    for bad in r.sample(breakers, 4):
        b.add("broken-yaml", _insert_line(text, r.randint(5, n), bad).encode(), ANY_LINE)
    extra = r.choice([("---\nb: 2\n", ANY_LINE), ("%YAML 9.9\n", ANY_LINE)])
    b.add(
        "documents",
        (text + "\n" + extra[0] if extra[0].startswith("-") else extra[0] + "---\n" + text).encode(),
        extra[1],
    )
    shape = r.choice(
        [b"- a\n- b\n", b"just text\n", b"", b"# only a comment\n", b"---\n...\n", b"42\n", b"[1, 2]\n", b"~\n"]
    )
    b.add("top-level", shape, r"{file}")
    b.add("duplicate-key", (text + "\nmodel: {name: x}\n").encode(), r"written twice")
    b.add("value-tag", text.replace("train:\n", "train:\n  lr: =\n", 1).encode(), r"train\.lr")
    b.add("too-big", (text + ("# " + "x" * 98 + "\n") * r.choice([11_000, 30_000])).encode(), r"{file}")


def bytes_(b) -> None:
    """Binary files, other encodings, NUL and control characters."""
    r, text = b.rng, b.text
    body = r.randbytes(r.choice([64, 4096]))
    b.add("binary", body, rf"{{file}}:{first_bad_line(body)}\b")
    b.add("utf16", text.encode("utf-16"), r"{file}:1\b")
    line = r.randint(1, text.count("\n"))
    latin = _insert_line(text, line, "# café ñ").encode("latin-1", errors="replace")
    b.add("latin1", latin, rf"{{file}}:{first_bad_line(latin)}\b")
    for char in r.sample(["\x00", "\x01", "\x08", "\x0b", "\x0c", "\x1b", "\x7f", "\ufffe", "\x00\x00\x00"], 3):
        pos = r.randint(0, len(text) - 1)
        body = (text[:pos] + char + text[pos:]).encode("utf-8")
        b.add("control-char", body, rf"{{file}}:{first_bad_line(body)}\b")


def bombs(b) -> None:
    """Alias expansion that grows exponentially or quadratically, recursive aliases, deep nesting."""
    r, text = b.rng, b.text
    depth, fan = r.choice([(6, 10), (9, 9), (12, 4)])
    rows = [f"  - &a0 [{', '.join(['lol'] * fan)}]"]
    rows += [f"  - &a{i} [{', '.join([f'*a{i - 1}'] * fan)}]" for i in range(1, depth)]
    b.add("alias-bomb", (text + "\nx-bomb:\n" + "\n".join(rows) + "\n").encode(), ANY_LINE)
    quad = f"\nx-a: &q [{', '.join(['x'] * 2000)}]\nx-b: [{', '.join(['*q'] * 2000)}]\n"
    b.add("alias-quadratic", (text + quad).encode(), ANY_LINE)
    b.add("alias-recursive", (text + "\nx-loop: &r [1, *r]\n").encode(), ANY_LINE)
    n = r.choice([200, 5000, 100_000])
    nest = r.choice(["[" * n + "]" * n, "{a: " * n + "1" + "}" * n])
    b.add("deep-flow", (text + "\nx-deep: " + nest + "\n").encode(), ANY_LINE)
    block = "".join(" " * i + "a:\n" for i in range(r.choice([70, 300]))) + " " * 300 + "b: 1\n"
    b.add("deep-block", (text + "\n" + block).encode(), ANY_LINE)


def tags(b) -> None:
    """Python object tags and other tags a job file has no use for."""
    from tests.fuzz.configs import RAW, STRINGS, dump, put

    r = b.rng
    for tag in r.sample(TAGS, 3):
        path = r.choice(STRINGS)
        body = dump(put(b.data, path, RAW), tag)
        b.add("tag", body, rf"{{file}}:{line_of(body, tag.split()[0])}\b")


def env(b) -> None:
    """${VAR} references that are unset (also inside a default) or that expand to bad values."""
    r = b.rng
    b.value(("model", "name"), "${FT_FUZZ_UNSET_1}", "env-missing")
    b.cases[-1] = _expect(b.cases[-1], "FT_FUZZ_UNSET_1")
    path = r.choice(INT_PATHS + [("model", "name"), ("output", "dir")])
    b.value(path, "${FT_FUZZ_UNSET_1:-${FT_FUZZ_UNSET_2}}", "env-nested-missing")
    b.cases[-1] = _expect(b.cases[-1], "FT_FUZZ_UNSET_2")
    b.value(r.choice(INT_PATHS), "${FT_FUZZ_UNSET_1:-${FT_FUZZ_UNSET_2:-true}}", "env-nested-bool")
    values = [
        "true",
        "1" + "0" * 100_000,
        "!!python/name:os.system",
        "-5",
        "[&a [1,1,1,1,1,1,1,1,1], &b [*a,*a,*a,*a,*a,*a,*a,*a,*a],"
        " &c [*b,*b,*b,*b,*b,*b,*b,*b,*b], &d [*c,*c,*c,*c,*c,*c,*c,*c,*c], &e [*d,*d,*d,*d,*d,*d,*d,*d,*d], "
        "&f [*e,*e,*e,*e,*e,*e,*e,*e,*e], &g [*f,*f,*f,*f,*f,*f,*f,*f,*f], &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]]",
    ]
    for value in r.sample(values, 2):
        path = r.choice(INT_PATHS)
        b.value(path, "${FT_FUZZ_VALUE}", "env-bad-value")
        b.cases[-1] = _replace(b.cases[-1], env={"FT_FUZZ_VALUE": value})
    b.value(("model", "name"), "${FT_FUZZ_VALUE}", "env-long-name")
    b.cases[-1] = _replace(b.cases[-1], env={"FT_FUZZ_VALUE": "m" * r.choice([300, 5000])})


def _expect(case, *more: str):
    return _replace(case, expect=case.expect + more)


def _replace(case, **changes):
    import dataclasses

    return dataclasses.replace(case, **changes)


BOMB = (
    "[&a [x,x,x,x,x,x,x,x,x,x], &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,*a], &c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b], "
    "&d [*c,*c,*c,*c,*c,*c,*c,*c,*c,*c], &e [*d,*d,*d,*d,*d,*d,*d,*d,*d,*d], &f [*e,*e,*e,*e,*e,*e,*e,*e,*e,*e], "
    "&g [*f,*f,*f,*f,*f,*f,*f,*f,*f,*f], &h [*g,*g,*g,*g,*g,*g,*g,*g,*g,*g]]"
)
OVERRIDES = [
    ("train.max_steps=true", r"train\.max_steps"),
    ("adapter.r=yes", r"adapter\.r"),
    ("model.name=!!python/name:os.system", r"--set model\.name"),
    ("train.lr=" + "9" * 50_000, r"train\.lr"),
    ("data.template=chatt", r"data\.template"),
    ("train.global_batch_size=1000000000", r"train\.global_batch_size"),
    ("x.y.z=1", r"unknown key 'x'"),
    ("data.datasets.9.path=a", r"--set data\.datasets\.9\.path"),
    ("train..lr=1", r"--set train\.\.lr"),
    ("noequals", r"--set noequals"),
    ("model=[", r"--set model=\["),
    ("data.datasets=" + BOMB, r"--set data\.datasets"),
    (".".join(["a"] * 5000) + "=1", r"--set a\.a\.a"),
    ("distributed.nodes=-1", r"distributed\.nodes"),
    ("train.micro_batch_size=0", r"train\.micro_batch_size"),
    ("train.warmup_steps=" + str(10**30), r"train\.warmup_steps"),
    ("model.name=" + "n" * 5000, r"model\.name"),
    ('output.dir="a\\0b"', r"output\.dir"),
    ("train=5", r"train"),
]


def overrides(b) -> None:
    """Bad `--set` arguments on a valid file."""
    body = b.text.encode()
    for item, expect in b.rng.sample(OVERRIDES, 5):
        b.add("set", body, expect, args=("--set", item))
