"""What `ft preprocess` shows: a summary of the prepared data, and samples with trained tokens highlighted."""

from __future__ import annotations

from finetune.data.masking import IGNORE


def print_summary(summary: dict, console) -> None:
    from rich.table import Table

    table = Table(title="Prepared data", title_justify="left", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    lengths = summary.get("token_lengths", {})
    rows = [
        ("records read", summary["records_read"]),
        ("unreadable, skipped", summary["skipped_unreadable"]),
        ("after sampling (weights/samples)", summary["records_sampled"]),
        ("bad records, skipped", summary["skipped_bad_records"]),
        ("truncated to seq_len", summary["truncated"]),
        ("dropped: longer than seq_len", summary["dropped_too_long"]),
        ("dropped: no token to train", summary["dropped_nothing_to_train"]),
        ("training samples", summary["train_samples"]),
        ("validation samples", summary.get("validation_samples", 0)),
        (
            "tokens per sample p50 / p90 / p99 / max",
            " / ".join(str(lengths.get(k, "-")) for k in ("p50", "p90", "p99", "max")),
        ),
        ("tokens per epoch", f"{summary['tokens_per_epoch']:,}"),
        ("trained tokens per epoch", f"{summary['trained_tokens_per_epoch']:,}"),
        ("efficiency if padded to seq_len", f"{100 * summary['padding_efficiency']:.1f}%"),
    ]
    if "packing_efficiency" in summary:
        rows.append(
            (
                "packing efficiency (real tokens / slots)",
                f"{100 * summary['packing_efficiency']:.1f}% in {summary['packed_rows']:,} rows",
            )
        )
    if summary.get("added_tokens"):
        rows.append(("special tokens added (embeddings grow)", ", ".join(summary["added_tokens"])))
    for what, value in rows:
        table.add_row(what, f"{value:,}" if isinstance(value, int) else str(value))
    console.print(table)
    print_skipped(
        summary.get("skipped_examples") or [], summary["skipped_unreadable"] + summary["skipped_bad_records"], console
    )


def print_skipped(examples: list[str], total: int, console) -> None:
    """The first skipped records (data.skip_bad_records), each as "file:line: reason", so they can be fixed."""
    if not examples:
        return
    console.print(f"skipped {total:,} bad record{'s' if total != 1 else ''}; the first {len(examples)}:")
    for example in examples:
        console.print(f"  {example}", markup=False)


def samples(row: dict) -> list[tuple[list[int], list[int]]]:
    """(input_ids, labels) of each sample in a row; a packed row holds several."""
    if "input_ids" not in row:
        return (
            [(row["chosen_input_ids"], row["chosen_labels"]), (row["rejected_input_ids"], row["rejected_labels"])]
            if "chosen_input_ids" in row
            else [(row["prompt_ids"], [IGNORE] * len(row["prompt_ids"]))]
        )
    ids, labels, out, start = row["input_ids"], row["labels"], [], 0
    for n in row.get("seq_lens") or [len(ids)]:
        out.append((ids[start : start + n], labels[start : start + n]))
        start += n
    return out


def highlighted(ids: list[int], labels: list[int], tokenizer):
    """Rich Text: trained tokens on green, the rest dim; newlines shown as ↵."""
    from rich.text import Text

    text = Text()
    for i, (tok, lab) in enumerate(zip(ids, labels)):
        piece = tokenizer.decode([tok]).replace("\n", "↵\n")
        trained = lab != IGNORE and i > 0
        text.append(piece, style="bold black on green" if trained else "dim")
    return text


def print_preview(dataset, tokenizer, n: int, console) -> None:
    shown = 0
    for row in dataset:
        for ids, labels in samples(row):
            if shown >= n:
                return
            trained = sum(1 for i, lab in enumerate(labels) if lab != IGNORE and i > 0)
            console.rule(f"sample {shown + 1}: {len(ids)} tokens, {trained} trained (highlighted)")
            console.print(highlighted(ids, labels, tokenizer))
            shown += 1
