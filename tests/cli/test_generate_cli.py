"""`draftsmith generate` end to end on a tiny model directory."""

import subprocess
import sys

import pytest

from draftsmith.cli import main
from draftsmith.speculative.loading import load_model
from draftsmith.speculative.prompts import encode_prompt, stop_token_ids
from draftsmith.speculative.tiny import tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    tok = tiny_tokenizer()
    for name, seed, layers in [("target", 0, 3), ("drafter", 1, 1)]:
        tiny_model(seed, num_layers=layers).save_pretrained(root / name)
        tok.save_pretrained(root / name)
    return root


@pytest.mark.parametrize("drafter", [None, "ngram", "early-exit:1", "drafter"])
def test_streams_text_to_stdout_and_stats_to_stderr(model_dirs, capsys, drafter):
    args = ["generate", "--target", str(model_dirs / "target"), "--prompt", "hello hello", "--chat",
            "--max-new-tokens", "12", "--draft-len", "3"]
    if drafter:
        args += ["--drafter", str(model_dirs / drafter) if drafter == "drafter" else drafter]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert out.strip()  # the generated text only
    assert "tok/s" in err and "tok/s" not in out
    if drafter:
        assert "AL " in err


def test_same_text_for_every_drafter(model_dirs, capsys, hf_greedy):
    texts = []
    for drafter in [[], ["--drafter", "ngram"], ["--drafter", str(model_dirs / "drafter")],
                    ["--drafter", "early-exit:2", "--draft-alternatives", "4", "--leaf-min-prob", "0.02"]]:
        code = main(["generate", "--target", str(model_dirs / "target"), "--prompt", "abcabc", "--max-new-tokens",
                     "16", *drafter])
        out, err = capsys.readouterr()
        assert code == 0, (drafter, err)
        texts.append(out)
    assert texts[0] == texts[1] == texts[2] == texts[3]
    # ... and that text is the target's own greedy continuation (stop tokens dropped, as the CLI prints it).
    target = load_model(str(model_dirs / "target"))
    prompt = encode_prompt(target.tokenizer, "abcabc", chat=False)
    expected = hf_greedy(target.model, prompt, 16, eos=stop_token_ids(target.model, target.tokenizer))
    assert texts[0] == target.tokenizer.decode(expected, skip_special_tokens=True) + "\n"


@pytest.mark.parametrize("args, message", [
    (["--target", "/no/such/dir"], "no such file or directory"),
    (["--drafter", "early-exit:x"], "not an integer"),
    (["--drafter", "early-exit:9"], "early-exit:N needs"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "0"], "top_p"),
    (["--drafter", "ngram", "--draft-alternatives", "-1"], "draft alternatives must be >= 0"),
    (["--drafter", "ngram", "--draft-alternatives", "2", "--leaf-min-prob", "1.5"], "leaf min prob must lie in [0, 1)"),
])
def test_bad_input_is_one_line_and_exit_2(model_dirs, args, message, capsys):
    base = ["generate", "--target", str(model_dirs / "target"), "--prompt", "hi"]
    if args[0] == "--target":
        base = ["generate", "--prompt", "hi"]
    code = main([*base, *args])  # in process: a subprocess spends seconds importing torch and transformers
    err = capsys.readouterr().err
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1].startswith("error: ") and message in lines[-1]
    assert "Traceback" not in err


def test_bad_input_in_a_subprocess_is_one_line_and_exit_2(model_dirs):
    """The same contract at the process boundary: `python -m draftsmith` exits 2 with one error line."""
    proc = subprocess.run([sys.executable, "-m", "draftsmith", "generate", "--target", str(model_dirs / "target"),
                           "--prompt", "hi", "--drafter", "early-exit:9"], capture_output=True, text=True)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr  # nothing else reaches stderr, library warnings included
    assert lines[-1].startswith("error: ") and "early-exit:N needs" in lines[-1]
    assert "Traceback" not in proc.stderr


def test_mismatched_tokenizer_is_refused(model_dirs, tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    other = tmp_path / "other"
    LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(other)
    tok = tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|x|>"]})
    tok.save_pretrained(other)
    code = main(["generate", "--target", str(model_dirs / "target"), "--drafter", str(other), "--prompt", "hi"])
    assert code == 2
    assert "tokenizers differ" in capsys.readouterr().err
