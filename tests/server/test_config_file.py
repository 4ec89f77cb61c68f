"""`ascendserve serve --config FILE` (vLLM's YAML flags file) and `--flag_name` spelled with underscores."""

import subprocess
import sys
import textwrap

import pytest

from ascendserve.cli import serve as serve_cli
from ascendserve.cli.config_file import normalize_flag_names
from ascendserve.cli.main import main


@pytest.fixture
def started(monkeypatch):
    """Run `main()` up to the point where the engine would load; return what it would serve with."""
    seen = {}

    def fake_serve(ns, args, chat_template, sock):
        seen.update(ns=ns, args=args, chat_template=chat_template)
    monkeypatch.setattr(serve_cli, "serve", fake_serve)
    monkeypatch.setattr(serve_cli, "bind_socket", lambda ns: None)
    return seen


def write(tmp_path, text: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(textwrap.dedent(text))
    return str(path)


QWEN_CONFIG = """\
    # the flags of a Qwen3.5 vllm serve line, as a vLLM config file holds them
    model: Qwen/Qwen3.5-27B
    host: "127.0.0.1"
    port: 6379
    uvicorn-log-level: "warning"
    max_model_len: 32768
    reasoning-parser: qwen3
    tool-call-parser: qwen3_coder
    enable-auto-tool-choice: true
    enable-prefix-caching: false
    served-model-name: [qwen3.5, qwen]
    default-chat-template-kwargs: {enable_thinking: false}
    hf-overrides:
      max_position_embeddings: 65536
    seed: 7
    """


def test_a_vllm_config_file_sets_the_flags(started, tmp_path):
    assert main(["serve", "--config", write(tmp_path, QWEN_CONFIG)]) == 0
    ns, args = started["ns"], started["args"]
    assert args.model == "Qwen/Qwen3.5-27B" and args.max_model_len == 32768 and args.seed == 7
    assert (ns.host, ns.port, ns.uvicorn_log_level) == ("127.0.0.1", 6379, "warning")
    assert ns.reasoning_parser == "qwen3" and ns.tool_call_parser == "qwen3_coder" and ns.enable_auto_tool_choice
    assert args.enable_prefix_caching is False  # a false BooleanOptionalAction is its --no- form
    assert ns.served_model_name == ["qwen3.5", "qwen"]
    assert ns.default_chat_template_kwargs == {"enable_thinking": False}  # a mapping is the JSON flag's value
    assert args.hf_overrides == {"max_position_embeddings": 65536}


def test_the_command_line_wins_over_the_file(started, tmp_path):
    path = write(tmp_path, QWEN_CONFIG)
    assert main(["serve", "my/model", "--config", path, "--port", "9000", "--enable-prefix-caching",
                 "--max-model-len=1024"]) == 0
    ns, args = started["ns"], started["args"]
    assert args.model == "my/model"  # the positional MODEL beats the file's model
    assert ns.port == 9000 and args.enable_prefix_caching is True and args.max_model_len == 1024
    assert ns.host == "127.0.0.1"  # what the command line does not name comes from the file
    started.clear()
    assert main(["serve", "--model", "other/model", f"--config={path}"]) == 0
    assert started["args"].model == "other/model"


def test_a_false_switch_is_off_and_an_empty_file_changes_nothing(started, tmp_path):
    assert main(["serve", "--config", write(tmp_path, "enforce_eager: false\ntrust-remote-code: true\n")]) == 0
    assert started["args"].enforce_eager is False and started["args"].trust_remote_code is True
    started.clear()
    assert main(["serve", "--config", write(tmp_path, "# nothing yet\n")]) == 0
    assert started["ns"].port == 8000


@pytest.mark.parametrize("text, message", [
    ("nope: 1\n", "unknown key 'nope': no `ascendserve serve` flag --nope"),
    ("enforce-eager: 3\n", "'enforce-eager' is a switch: true or false, got 3"),
    ("- max-model-len\n", "the file must be a mapping of flag names to values"),
    ("max-model-len: [1, 2]\n", "'max-model-len' takes one value, got a list"),
    ("served-model-name: []\n", "'served-model-name' is an empty list"),
    ("max-model-len:\n", "'max-model-len' has no value"),
    ("config: other.yaml\n", "a config file cannot name another one"),
    ("help: true\n", "'help' is not a setting"),
    ("model: 3\n", "'model' must be a model path or repo id, got 3"),
    ("port: [unclosed\n", "not valid YAML"),
])
def test_a_bad_config_file_is_one_error_naming_file_and_key(started, tmp_path, capsys, text, message):
    path = write(tmp_path, text)
    with pytest.raises(SystemExit) as e:
        main(["serve", "--config", path])
    assert e.value.code == 2 and not started
    err = capsys.readouterr().err
    assert f"ascendserve serve: error: --config {path}: " in err and message in err, err


def test_a_bad_value_in_the_file_is_the_flags_own_error(started, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--config", write(tmp_path, "port: 70000\n")])
    assert "argument --port: a port is 0 to 65535, got 70000" in capsys.readouterr().err and not started


def test_a_config_file_that_is_not_utf8_is_an_error_not_a_traceback(started, tmp_path, capsys):
    path = tmp_path / "config.yaml"
    path.write_bytes(b"port: \xff\xfe\n")
    with pytest.raises(SystemExit) as e:
        main(["serve", "--config", str(path)])
    assert e.value.code == 2 and not started
    assert f"--config {path}: not UTF-8 text (invalid start byte at byte 6)" in capsys.readouterr().err
    from ascendserve.cli import allocator
    assert allocator._device(["serve", "--config", str(path)]) == "auto"  # the parser reports it, not the restart


def test_a_missing_config_file(started, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--config", str(tmp_path / "missing.yaml")])
    assert "cannot read it (No such file or directory)" in capsys.readouterr().err


def test_flag_names_with_underscores_as_vllm_reads_them(started):
    line = ["serve", "--max_model_len", "2048", "--gpu_memory_utilization=0.5", "--enable_prefix_caching",
            "--served_model_name", "a_b"]
    assert main(line) == 0
    args = started["args"]
    assert args.max_model_len == 2048 and args.gpu_memory_utilization == 0.5 and args.enable_prefix_caching
    assert started["ns"].served_model_name == ["a_b"]  # values keep their underscores


def test_normalize_flag_names_touches_only_long_flag_names():
    argv = ["serve", "my_model", "--max_num_seqs=4", "-O", "--chat-template", "{{ a_b }}", "--", "--x_y"]
    assert normalize_flag_names(argv) == ["serve", "my_model", "--max-num-seqs=4", "-O", "--chat-template",
                                          "{{ a_b }}", "--", "--x_y"]


def test_config_file_in_a_real_process(tmp_path):
    """The console entry point reads the file too (a bad key exits 2 before anything loads)."""
    path = write(tmp_path, "max-model-len: 512\nbogus-flag: 1\n")
    proc = subprocess.run([sys.executable, "-m", "ascendserve.cli.main", "serve", "--config", path],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown key 'bogus-flag'" in proc.stderr, proc.stderr
