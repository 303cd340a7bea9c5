"""Reward functions for the GRPO example: partial credit for arithmetic answers.

ft calls each as fn(completions, prompts=..., **columns, **args): `completions` are the generated
answers, `answer` is the dataset's column of the same name (one entry per completion).
"""


def digits_right(completions, answer, **_):
    """Fraction of the reference's characters that the completion has at the same position (1.0: exact)."""
    out = []
    for text, ref in zip(completions, answer):
        text, ref = text.strip(), str(ref)
        same = sum(a == b for a, b in zip(text, ref))
        out.append(same / max(len(ref), len(text), 1))
    return out
