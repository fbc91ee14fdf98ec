"""Recipes: typed, validated, overridable; every shipped recipe loads."""

import pytest

from draftsmith.speculative.errors import InvalidInputError
from draftsmith.train.config import RECIPES_DIR, load_recipe


@pytest.mark.parametrize("name", ["tiny-draft-lm", "tiny-medusa", "draft-lm-smollm2", "medusa-smollm2"])
def test_shipped_recipes_load(name):
    recipe = load_recipe(name)
    assert recipe.name == name
    assert (RECIPES_DIR / f"{name}.yaml").is_file()


def test_overrides_use_dotted_keys_and_yaml_values():
    recipe = load_recipe("tiny-medusa", ["train.steps=7", "loss.kind=jsd", "data.prompts=[a.jsonl, b.jsonl]",
                                         "tracking.report_to=none"])
    assert recipe.train.steps == 7 and recipe.loss.kind == "jsd"
    assert recipe.data.prompts == ["a.jsonl", "b.jsonl"]
    assert recipe.head_weights() == pytest.approx([1.0, 0.8, 0.64])


def test_mixed_precision_no_survives_yaml():
    # YAML 1.1 reads a bare `no` as false; the recipe key still means full precision, not an error.
    for value in ("no", "false", "'no'"):
        assert load_recipe("tiny-medusa", [f"train.mixed_precision={value}"]).train.mixed_precision == "no"
    assert load_recipe("tiny-medusa", ["train.mixed_precision=bf16"]).train.mixed_precision == "bf16"
    with pytest.raises(InvalidInputError, match="train.mixed_precision"):
        load_recipe("tiny-medusa", ["train.mixed_precision=yes"])


@pytest.mark.parametrize("override, message", [
    ("train.stepz=3", "unknown key 'train.stepz'"),
    ("bogus=1", "unknown key 'bogus'"),
    ("train.steps=many", "train.steps"),
    ("loss.kind=mse", "loss.kind"),
    ("train.lr=-1", "train.lr"),
    ("on_policy.fraction=0.5", "on_policy.fraction > 0 needs drafter.kind: draft-lm"),
    ("loss.head_weights=[1, 2]", "head_weights"),
    ("steps", "key=value"),
])
def test_bad_recipes_name_the_key(override, message):
    with pytest.raises(InvalidInputError, match=message) as err:
        load_recipe("tiny-medusa", [override])
    assert "\n" not in str(err.value)


def test_missing_and_malformed_recipe_files(tmp_path):
    with pytest.raises(InvalidInputError, match="no such recipe"):
        load_recipe(str(tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed")
    with pytest.raises(InvalidInputError, match="not valid YAML"):
        load_recipe(str(bad))
    bad.write_text("- a\n- b\n")
    with pytest.raises(InvalidInputError, match="mapping"):
        load_recipe(str(bad))
    bad.write_text("name: x\n")
    with pytest.raises(InvalidInputError, match="missing required key 'output_dir'"):
        load_recipe(str(bad))


@pytest.mark.parametrize("flags, native", [
    ("fpu sse2 avx2 avx512f avx512bw avx512_bf16 avx512_fp16", True),   # Zen 4/5, Cooper Lake on
    ("fpu sse2 avx2 avx512f amx_tile amx_bf16 amx_int8", True),
    ("fpu sse2 avx2 avx512f avx512bw avx512_vnni", False),               # Skylake-SP: bf16 only emulated
    ("fpu sse2 avx avx2", False),
])
def test_bf16_on_a_cpu_is_asked_for_and_warned_about_where_it_is_emulated(tmp_path, monkeypatch, capsys,
                                                                         flags, native):
    from draftsmith.speculative import calibrate
    from draftsmith.train import loop

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: test\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")
    assert loop.cpu_has_native_bf16(str(cpuinfo)) is native
    monkeypatch.setattr(loop.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(loop, "cpu_has_native_bf16", lambda: native)
    monkeypatch.setattr(calibrate, "cpu_has_native_bf16", lambda: native)  # (read by native_bf16)
    assert loop.resolve_precision("auto") == "no"  # a CPU: autocast only where a recipe asks for it
    assert loop.resolve_precision("bf16") == "bf16" and loop.resolve_precision("no") == "no"
    assert loop.resolve_precision("bf16-if-native") == ("bf16" if native else "no")
    # (no Accelerator here: accelerate keeps one global state per process, and later tests ask for "no")
    loop.warn_if_bf16_is_emulated("bf16")
    warned = capsys.readouterr().err
    assert ("no bf16 arithmetic" in warned) is not native and "\n" not in warned.strip()


def test_cpu_feature_flags_of_arm_and_of_no_cpuinfo(tmp_path):
    from draftsmith.train.loop import cpu_has_native_bf16

    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd sve sve2 bf16 i8mm\nCPU implementer\t: 0x41\n")
    assert cpu_has_native_bf16(str(arm))
    older = tmp_path / "older-arm"
    older.write_text("processor\t: 0\nFeatures\t: fp asimd evtstrm aes crc32\n")
    assert not cpu_has_native_bf16(str(older)) and not cpu_has_native_bf16(str(tmp_path / "none"))
