"""A job file's `${VAR}`: the run folder records what each variable named (a secret stays `${VAR}`), and ft eval,
ft generate and ft merge-lora of the run folder, without the variable, load the adapter on the base it was trained
on, or refuse when the run and its adapter disagree (issue 29)."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from finetune.artifacts import find_adapter, resolve
from finetune.config import loads
from finetune.errors import FtError
from finetune.modelcard import model_card
from finetune.redaction import redact_config
from finetune.resume import resume_checks
from tests.helpers import REPO, JobText, varied_tiny_model

TOKEN = "hf_" + "a1B2c3D4e5" * 4  # looks like a Hugging Face token, whatever the variable is called


def _job(tmp_path, extra: str = "") -> str:
    data = tmp_path / "d.jsonl"
    row = {"messages": [{"role": "user", "content": "1 + 1?"}, {"role": "assistant", "content": "2"}]}
    data.write_text(json.dumps(row) + "\n")
    return JobText(f"""
model: {{name: "${{FT_BASE:-ft-tiny}}"}}
data: {{datasets: [{{path: "{data}", format: chat}}], seq_len: 48}}
adapter: {{type: lora, r: 4, alpha: 8, dropout: 0.0}}
output: {{dir: "{tmp_path / "run"}", run_name: "${{FT_LABEL:-plain}}"}}
{extra}""")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{base, adapter}: a tiny model unlike ft-tiny (its weights drawn larger), saved at a temporary path, and a LoRA
    adapter on it saved by peft (adapter_config.json names that path as its base)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("env-recorded")
    base = varied_tiny_model(root / "base")
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32),
        LoraConfig(r=2, target_modules=["q_proj", "v_proj"], lora_dropout=0.0),
    )
    peft_model.save_pretrained(str(root / "adapter"))
    return {"base": base, "adapter": root / "adapter"}


def _run_folder(tmp_path, models, environ: dict, written: dict | None = None):
    """A run folder as ft train writes it for `_job` under `environ` (config.yaml through redact_config, as
    workflow.write_run_folder writes it; or `written`, as written), with the adapter as final/."""
    run = tmp_path / "run"
    shutil.copytree(models["adapter"], run / "final")
    if written is None:
        written = redact_config(loads(_job(tmp_path), environ=environ), exclude_unset=True)
    (run / "config.yaml").write_text(yaml.safe_dump(written, sort_keys=False))
    (run / "plan.json").write_text(json.dumps({"adapter": "lora"}))
    return run


# ---------------------------------------------------------------- what the run folder records
def test_a_plain_variable_is_recorded_in_the_run_config_and_the_model_card(tmp_path, models):
    base = str(models["base"])
    config = loads(_job(tmp_path), environ={"FT_BASE": base, "FT_LABEL": "nightly-42"})
    saved = yaml.safe_dump(redact_config(config, exclude_unset=True), sort_keys=False)
    again = loads(saved, environ={})  # later readers of the run folder need no variable
    assert again.model.name == base and again.output.run_name == "nightly-42" and "${" not in saved
    card = model_card({"config": config, "plan": {"model": base}})
    assert f'base_model: "{base}"' in card and "nightly-42" in card and "${FT_BASE" not in card


def _secret_job(tmp_path, run_name: str) -> str:
    """`_job` with a second data source whose URL carries ${FT_DATA_TOKEN}, and the given output.run_name."""
    url = "{path: 'https://${FT_DATA_TOKEN}@example.com/d.jsonl', format: chat}"
    return _job(tmp_path).replace("format: chat}]", f"format: chat}}, {url}]").replace("${FT_LABEL:-plain}", run_name)


def test_secret_names_and_secret_looking_values_stay_references(tmp_path):
    env = {"FT_BASE": "org/model", "FT_LABEL": TOKEN, "FT_DATA_TOKEN": "opensesame123"}
    config = loads(_secret_job(tmp_path, "${FT_LABEL}"), environ=env)
    out = redact_config(config, exclude_unset=True)
    assert out["model"]["name"] == "org/model"  # not a secret: recorded
    assert out["output"]["run_name"] == "${FT_LABEL}"  # a token's value, under a plain name
    assert out["data"]["datasets"][1]["path"] == "https://${FT_DATA_TOKEN}@example.com/d.jsonl"  # a secret's name
    text = json.dumps(out) + model_card({"config": config, "name": TOKEN})
    assert TOKEN not in text and "opensesame123" not in text
    assert loads(yaml.safe_dump(out), environ=env).model_dump() == config.model_dump()
    shared = loads(_secret_job(tmp_path, "run-${FT_DATA_TOKEN}"), environ=env)  # read by a secret reference too
    assert redact_config(shared)["output"]["run_name"] == "run-${FT_DATA_TOKEN}"


# ---------------------------------------------------------------- later commands without the variable
def test_eval_generate_and_merge_without_the_variable_use_the_recorded_base(tmp_path, models, monkeypatch):
    from finetune.infer.commands import EvalOptions, GenerateOptions, run_eval, run_generate
    from finetune.merge import merge_lora

    run = _run_folder(tmp_path, models, {"FT_BASE": str(models["base"])})
    monkeypatch.delenv("FT_BASE", raising=False)
    monkeypatch.chdir(tmp_path)
    src = resolve(str(run))
    assert src.model == str(models["base"]) and src.where == f"model.name in {run / 'config.yaml'}"
    assert merge_lora(run, tmp_path / "merged", check_inputs=1).base == str(models["base"])
    (tmp_path / "q.jsonl").write_text(json.dumps({"id": 0, "prompt": "What is 2 + 3?"}) + "\n")
    for source, out in ((run, "run.jsonl"), (models["adapter"], "own.jsonl")):  # the run, and the adapter on its base
        run_generate(GenerateOptions(str(source), "q.jsonl", out, max_new_tokens=6, processes=1, quiet=True))
    assert (tmp_path / "run.jsonl").read_text() == (tmp_path / "own.jsonl").read_text()
    data = tmp_path / "d.jsonl"
    on_run, on_own, on_tiny = (
        run_eval(EvalOptions(str(run), data=str(data), metrics=("loss",), quiet=True, base=base)).metrics["loss"]
        for base in (None, str(models["base"]), "ft-tiny")
    )
    assert on_run == on_own != on_tiny  # ft-tiny is what the run folder named before it recorded the variable


def test_a_relative_base_is_read_from_the_folder_the_run_was_started_in(tmp_path, models, monkeypatch):
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    (tmp_path / "models" / "tiny" / "base").symlink_to(models["base"])  # the adapter names it by its absolute path
    run = _run_folder(tmp_path, models, {"FT_BASE": "models/tiny/base"})  # two slashes: no hub id
    monkeypatch.chdir(tmp_path)
    assert resolve(str(run)).model == "models/tiny/base"
    monkeypatch.chdir(models["base"])
    with pytest.raises(FtError, match=r"(?s)tiny/base does not exist in .*relative path.*fix: run from the folder"):
        resolve(str(run))


def test_a_run_whose_adapter_names_another_base_is_refused(tmp_path, models, capsys):
    from finetune.merge import merge_lora

    run = _run_folder(tmp_path, models, {})  # model.name: ft-tiny; the adapter was trained on models["base"]
    for attempt in (lambda: resolve(str(run)), lambda: merge_lora(run, tmp_path / "merged")):
        with pytest.raises(FtError) as err:
            attempt()
        message = str(err.value)
        assert "model.name" in message and str(models["base"]) in message and "adapter_config.json" in message
        assert "fix: pass --base" in message
    assert not (tmp_path / "merged").exists()
    assert resolve(str(run), base=str(models["base"])).model == str(models["base"])  # the fix it names works
    assert resolve(str(run), base="ft-tiny").where == "--base"  # as asked, with a note
    assert "is not the model the adapter was trained on" in capsys.readouterr().err


@pytest.mark.parametrize(
    "a, b, same",
    [
        ("ft-tiny", "ft-tiny", True),
        ("org/model", "ORG/model", True),
        ("org/model", "org/other", False),
        ("org/model", "/hf/hub/models--org--model/snapshots/abc123", True),  # sharded loading reads the hub's cache
        ("org/other", "/hf/hub/models--org--model/snapshots/abc123", False),
        ("org/model", "{base}", None),  # a hub id and a local folder: perhaps a save of it
        ("{base}", "{copy}", False),
        ("{base}", "{link}", True),
        ("{relative}", "{base}", True),
        ("./gone/model", "{base}", None),
    ],
)
def test_which_names_of_a_base_are_the_same_model(tmp_path, models, monkeypatch, a, b, same):
    from finetune.artifacts.bases import same_model

    shutil.copytree(models["base"], tmp_path / "copy")
    (tmp_path / "link").symlink_to(models["base"])
    monkeypatch.chdir(models["base"].parent)
    names = {"base": str(models["base"]), "copy": str(tmp_path / "copy"), "link": str(tmp_path / "link")}
    names["relative"] = models["base"].name
    assert same_model(a.format(**names), b.format(**names)) is same


# ---------------------------------------------------------------- run folders of an older ft: ${VAR} as written
def _older_run(tmp_path, models, environ: dict):
    config = loads(_job(tmp_path), environ=environ)
    return _run_folder(tmp_path, models, {}, redact_config(config, exclude_unset=True, as_references=True))


def test_an_older_run_folder_takes_the_adapters_own_base_and_says_so(tmp_path, models, monkeypatch, capsys):
    run = _older_run(tmp_path, models, {"FT_BASE": str(models["base"])})
    assert "${FT_BASE:-ft-tiny}" in (run / "config.yaml").read_text()
    monkeypatch.delenv("FT_BASE", raising=False)
    assert resolve(str(run)).model == str(models["base"])
    err = capsys.readouterr().err
    assert err.count("note:") == 1 and "recorded no value" in err and "ft-tiny here" in err
    monkeypatch.setenv("FT_BASE", str(models["base"]))  # the value it was trained with: nothing to say
    assert resolve(str(run)).model == str(models["base"]) and capsys.readouterr().err == ""


def test_an_older_run_folder_whose_adapters_base_is_not_here_is_refused(tmp_path, models, monkeypatch):
    run = _older_run(tmp_path, models, {"FT_BASE": str(models["base"])})
    adapter_config = run / "final" / "adapter_config.json"
    config = json.loads(adapter_config.read_text())
    adapter_config.write_text(json.dumps({**config, "base_model_name_or_path": str(tmp_path / "moved")}))
    monkeypatch.delenv("FT_BASE", raising=False)
    with pytest.raises(FtError, match=r"(?s)recorded no value.*not a folder here.*--base.*set FT_BASE"):
        find_adapter(run).base()


# ---------------------------------------------------------------- resuming
def test_resume_accepts_the_same_values_and_older_run_folders(tmp_path, models):
    base = {"FT_BASE": str(models["base"])}
    run = _run_folder(tmp_path, models, base)
    assert resume_checks(run, loads(_job(tmp_path), environ=base), None, None, False) is None
    with pytest.raises(FtError, match=r"model\.name: '.*base' -> 'ft-tiny'"):
        resume_checks(run, loads(_job(tmp_path), environ={}), None, None, False)  # the variable is gone
    shutil.rmtree(run)
    run = _run_folder(tmp_path, models, {})  # started without the variable, resumed without it
    assert resume_checks(run, loads(_job(tmp_path), environ={}), None, None, False) is None
    shutil.rmtree(run)
    run = _older_run(tmp_path, models, base)  # an older ft's ${VAR}: accepted as before
    assert resume_checks(run, loads(_job(tmp_path), environ=base), None, None, False) is None
    assert not (run / "resume-changes.jsonl").exists()


# ---------------------------------------------------------------- the README's DPO workflow
@pytest.mark.slow
def test_the_dpo_workflow_records_its_base_for_eval_and_merge(tmp_path, models, monkeypatch):
    from finetune.merge import merge_lora
    from tests.helpers import train_here

    monkeypatch.chdir(REPO)
    monkeypatch.setenv("BASE_MODEL", str(models["base"]))
    run = tmp_path / "tiny-dpo"
    overrides = [
        f"output.dir={run}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "train.max_steps=1",
        "output.eval_steps=0",
    ]
    train_here(REPO / "examples" / "yaml" / "tiny-dpo.yaml", *[x for o in overrides for x in ("--set", o)])
    monkeypatch.delenv("BASE_MODEL")
    assert yaml.safe_load((run / "config.yaml").read_text())["model"]["name"] == str(models["base"])
    assert f'base_model: "{models["base"]}"' in (run / "README.md").read_text()
    assert json.loads((run / "final" / "adapter_config.json").read_text())["base_model_name_or_path"] == str(
        models["base"]
    )
    assert resolve(str(run)).model == str(models["base"])
    assert merge_lora(run, tmp_path / "merged", check_inputs=1).base == str(models["base"])
