from __future__ import annotations

import re

import pytest
from conftest import ROOT

from batchgen.core.errors import ConfigError
from batchgen.core.settings import MediaConfig, RunConfig
from batchgen.execution.config import build_config, find_preset


def test_presets_are_found_by_name_and_by_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not the project folder: names fall back to the project's configs/
    assert find_preset("qwen2.5-vl-captioning") == ROOT / "configs" / "qwen2.5-vl-captioning.yaml"
    config = build_config("jobs.jsonl", "out.parquet", "qwen2.5-vl-captioning")
    assert config.model == "mlx-community/Qwen2.5-VL-3B-Instruct-4bit"
    assert (config.defaults.temperature, config.defaults.max_tokens, config.batch_size) == (0.0, 128, 16)
    assert config.media.video_fps == 1.0
    own = tmp_path / "mine.yaml"
    own.write_text("model: some/model\ngeneration: {top_k: 5}\n")
    assert build_config("j.jsonl", "o.parquet", str(own)).defaults.top_k == 5
    with pytest.raises(ConfigError, match="config 'nope' not found"):
        find_preset("nope")


def test_default_preset_and_flags(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    config = build_config("j.jsonl", "o.parquet")
    assert config.model.endswith("shapes-vlm") and config.text_model.endswith("tiny-lm")
    # --model alone means that model for every row, not the preset's text model beside it.
    alone = build_config("j.jsonl", "o.parquet", model="other")
    assert (alone.model, alone.text_model) == ("other", None)
    flags = build_config("j.jsonl", "o.parquet", generation={"max_tokens": 7, "stop": None})
    assert flags.defaults.max_tokens == 7 and flags.defaults.temperature == 0.0  # flag over preset
    for bad, message in [
        ({"generation": {"temperature": -1}}, "temperature"),
        ({"batch_size": 0}, "batch_size"),
    ]:
        with pytest.raises(ConfigError, match=message):
            if "generation" in bad:
                build_config("j.jsonl", "o.parquet", generation=bad["generation"])
            else:
                build_config("j.jsonl", "o.parquet", **bad)


def test_each_generation_parameter_is_declared_once_and_everything_derives_from_it():
    from conftest import run_cli

    from batchgen.core.params import NUMBERS, PARAMS
    from batchgen.input.formats import csv_cell
    from batchgen.input.openai_batch import from_batch_request

    code, helptext = run_cli("run", "--help")
    flat = " ".join(helptext.split())
    assert code == 0 and "[48 from the default preset]" in flat and "[0.0 from the default preset]" in flat
    for p in PARAMS:
        assert (f"--{p.name.replace('_', '-')}" in flat) == (p.cli is not None)
    assert csv_cell("top_k", "5") == 5 and csv_cell("system", "5") == "5" and "seed" in NUMBERS
    row, problems = from_batch_request(
        {"custom_id": "a", "body": {"messages": [], "max_completion_tokens": 7, "top_p": 0.5}}
    )
    assert (row["max_tokens"], row["top_p"], problems) == (7, 0.5, [])


@pytest.mark.slow  # builds and installs a wheel
def test_a_wheel_installed_outside_the_checkout_finds_its_presets(tmp_path):
    """The presets ship in the package: built as a wheel, installed elsewhere, looked up by
    name from a folder that has no configs/ (and with the checkout's editable install out of
    the way: no site hooks, the wheel's folder first on the path)."""
    import site
    import subprocess
    import sys

    wheels, target = tmp_path / "wheels", tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(ROOT)],
                   check=True, capture_output=True, timeout=300)  # fmt: skip
    (wheel,) = wheels.glob("batchgen-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                    str(wheel)], check=True, capture_output=True, timeout=300)  # fmt: skip
    probe = (
        f"import sys; sys.path[:0] = [{str(target)!r}, *{site.getsitepackages()!r}]\n"
        "import batchgen, batchgen.execution.config as c\n"
        "config = c.build_config('jobs.jsonl', 'out.parquet', 'qwen2.5-vl-captioning')\n"
        "print(batchgen.__file__, c.find_preset('qwen2.5-vl-captioning'), config.model, config.batch_size)\n"
    )
    done = subprocess.run([sys.executable, "-S", "-c", probe], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    module, preset, model, batch_size = done.stdout.split()
    assert module.startswith(str(target)) and preset.startswith(str(target))
    assert preset.endswith("batchgen/configs/qwen2.5-vl-captioning.yaml")
    assert (model, batch_size) == ("mlx-community/Qwen2.5-VL-3B-Instruct-4bit", "16")
    # The README's first command from the wheel, with no sample models beside it: one line of advice.
    (tmp_path / "jobs.jsonl").write_text('{"id": 1, "prompt": "Hi."}\n')
    first = (
        f"import sys; sys.path[:0] = [{str(target)!r}, *{site.getsitepackages()!r}]\n"
        "from batchgen.cli import main\n"
        "main(['run', 'jobs.jsonl', '-o', 'results.parquet'])\n"
    )
    done = subprocess.run([sys.executable, "-S", "-c", first], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert (
        "error: no model: pass --model PATH_OR_ID" in done.stderr
        and "--config qwen2.5-vl-captioning" in done.stderr
    )


# Each real-model preset and the tiny checkpoint of its model's family (families-notes.md):
# the preset's settings run a row on that family offline. A new preset names its stand-in here.
STAND_INS = {
    "qwen2.5-vl-captioning": "qwen2_5_vl",
    "qwen3-vl-video": "qwen3_vl",
    "olmocr-documents": "vlm",
    "caption-then-vqascore": "qwen2_5_vl",
}


@pytest.mark.slow  # builds a tiny checkpoint per family
@pytest.mark.parametrize("preset", sorted(STAND_INS))
def test_each_real_model_preset_runs_on_a_tiny_stand_in_of_its_family(tmp_path, preset):
    import json

    from conftest import MEDIA, read, run_cli

    from batchgen.tools.tiny.builder import make_tiny_model

    presets = {p.stem for p in (ROOT / "configs").glob("*.yaml")} - {"default"}
    assert presets == set(STAND_INS)  # every preset has its stand-in
    config = build_config("j.jsonl", "o.parquet", preset)
    assert config.model.startswith("mlx-community/")
    model = make_tiny_model(tmp_path / "model", STAND_INS[preset])
    assert json.loads((model / "config.json").read_text())["model_type"] in {
        "qwen2_vl",
        "qwen2_5_vl",
        "qwen3_vl",
    }
    job = tmp_path / "jobs.jsonl"
    rows = [{"id": "img", "image": str(MEDIA / "red_circle.png"), "prompt": "Describe it."},
            {"id": "clip", "video": str(MEDIA / "moving_dot.mp4"), "prompt": "What moves?"}]  # fmt: skip
    job.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.parquet"
    code, output = run_cli("run", str(job), "-o", str(out), "--config", preset, "--model", str(model),
                           "--max-tokens", "4", "-q")  # fmt: skip
    assert code == 0, output
    rows = read(out)
    if config.stages:  # each stage's status; a row the first stage's keep_if drops stops there
        assert [r[f"{config.stages[0].name}.status"] for r in rows] == ["ok", "ok"]
        assert all(r["dropped_at"] in (None, *(s.name for s in config.stages)) for r in rows)
    else:
        assert [r["status"] for r in rows] == ["ok", "ok"]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"batch_size": 0}, "batch_size must be >= 1"),
        ({"executor": "slurm"}, "--engine 'slurm': expected local or ray"),
        ({"fail_on": "tonight"}, "--fail-on 'tonight': expected any, new or none"),
        ({"kv_bits": 7}, "--kv-bits 7: expected one of 2, 3, 4, 5, 6, 8"),
        ({"time_limit": -1.0}, "--time-limit '-1.0': must be more than 0 seconds"),
        ({"memory_budget": "lots"}, "--memory-budget"),
        ({"drop_result_columns": ("id",)}, "--drop-result-columns 'id': every output keeps it"),
    ],
)
def test_a_run_config_made_in_python_checks_itself_as_the_cli_does(settings, message):
    """Without build_config (a script, a notebook): the same refusal, by the same words."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        RunConfig(input="j.jsonl", output="o.parquet", model="m", **settings)
    with pytest.raises(ConfigError, match=re.escape(message)):  # and the CLI's way says the same
        build_config("j.jsonl", "o.parquet", model="m", **settings)
    assert RunConfig(input="j.jsonl", output="o.parquet", model="m").batch_size == 32
    with pytest.raises(ConfigError, match="retries, fetch_workers and decode_workers must be >= 1"):
        MediaConfig(retries=0)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"max_tokens": 0}, "generation parameter max_tokens: expected a positive integer, got 0"),
        ({"top_p": 1.5}, "generation parameter top_p: expected a number in (0, 1]"),
        ({"stop": ("",)}, "generation parameter stop: expected a string or a list of non-empty strings"),
        ({"logit_bias": ((5, -200.0),)}, "generation parameter logit_bias"),
        ({"choices_to_score": ("yes", "yes")}, "'yes' given twice"),
        ({"completions": 99}, "generation parameter completions"),
        ({"tools": ({"type": "web"},)}, "tools[0]: expected {type: function"),
    ],
)
def test_generation_parameters_check_themselves_however_they_are_made(values, message):
    """GenParams made in Python, or changed by `dataclasses.replace`, meet the rules a row's
    values meet; a good value of every kind (pairs, tuples, objects) is taken as it is."""
    import dataclasses

    from batchgen.core.params import GenParams

    with pytest.raises(ConfigError, match=re.escape(message)):
        GenParams(**values)
    with pytest.raises(ConfigError, match=re.escape(message)):
        dataclasses.replace(GenParams(), **values)
    tool = {"type": "function", "function": {"name": "f"}}
    good = GenParams(stop=("a", "bc"), logit_bias=((5, -100.0),), tools=(tool,), tool_choice="f")
    assert good.logit_bias == ((5, -100.0),) and good.tools == (tool,) and good.tool_choice == "f"
    with pytest.raises(TypeError):
        GenParams(64)  # type: ignore[misc]  # by keyword only
