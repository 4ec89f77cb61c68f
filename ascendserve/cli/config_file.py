"""Command lines as vLLM's parser reads them: `--flag_name` spelled with underscores, and `--config FILE`.

`vllm serve --config config.yaml` reads a YAML mapping of long flag names (`max-model-len: 4096`, or
`max_model_len`) to values; the command line wins over the file, and the file over the defaults. A
model given on the command line (positional or `--model`) wins over the file's `model`. Values by the
flag's kind: a switch takes true / false (`enforce-eager: true`; `enable-prefix-caching: false` is
`--no-enable-prefix-caching`), a list flag a list, a JSON flag a mapping, every other flag one scalar.
"""

import argparse
import json

CONFIG_FLAG = "--config"
_SWITCHES = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse.BooleanOptionalAction)


def normalize_flag_names(argv: list[str]) -> list[str]:
    """`--max_model_len 8` and `--max_model_len=8` as `--max-model-len`: vLLM's parser takes either spelling.
    Only the name before `=` changes; nothing after a bare `--` does."""
    out = []
    for i, arg in enumerate(argv):
        if arg == "--":
            return out + argv[i:]
        if arg.startswith("--") and "_" in arg.split("=", 1)[0]:
            name, sep, value = arg.partition("=")
            arg = name.replace("_", "-") + sep + value
        out.append(arg)
    return out


def read_config_file(path: str):
    """The YAML document at `path` (None for an empty file); OSError, UnicodeDecodeError (not UTF-8) or
    yaml.YAMLError where it does not read."""
    import yaml

    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)


def config_arguments(parser: argparse.ArgumentParser, path: str, cli_names_model: bool) -> list[str]:
    """The command-line arguments that the YAML file at `path` stands for (errors through `parser.error`,
    naming the file and the key)."""
    import yaml

    def fail(message: str):
        parser.error(f"{CONFIG_FLAG} {path}: {message}")

    try:
        data = read_config_file(path)
    except OSError as e:
        fail(f"cannot read it ({e.strerror or e})")
    except UnicodeDecodeError as e:
        fail(f"not UTF-8 text ({e.reason} at byte {e.start})")
    except yaml.YAMLError as e:
        fail(f"not valid YAML: {' '.join(str(e).split())}")
    if data is None:
        return []
    if not isinstance(data, dict):
        fail(f"the file must be a mapping of flag names to values (like 'max-model-len: 4096'), "
             f"not a {type(data).__name__}")
    args: list[str] = []
    for key, value in data.items():
        if not isinstance(key, str) or not key.strip("-"):
            fail(f"key {key!r} is not a flag name")
        name = "--" + key.lstrip("-").replace("_", "-")
        if name in ("--model", "--model-tag"):
            if not isinstance(value, str) or not value:
                fail(f"'{key}' must be a model path or repo id, got {value!r}")
            if not cli_names_model:
                args += ["--model", value]
            continue
        action = parser._option_string_actions.get(name)
        if name == CONFIG_FLAG:
            fail(f"'{key}': a config file cannot name another one")
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            fail(f"'{key}' is not a setting")
        if action is None:
            fail(f"unknown key '{key}': no `{parser.prog}` flag {name}")
        args += _flag_arguments(action, name, key, value, fail)
    return args


def _flag_arguments(action: argparse.Action, name: str, key: str, value, fail) -> list[str]:
    if isinstance(action, _SWITCHES):
        if not isinstance(value, bool):
            fail(f"'{key}' is a switch: true or false, got {value!r}")
        if isinstance(action, argparse.BooleanOptionalAction):
            return [name] if value else ["--no-" + name[2:]]
        return [name] if value else []
    if value is None:
        fail(f"'{key}' has no value")
    many = action.nargs in ("+", "*") or (isinstance(action.nargs, int) and action.nargs > 1)
    if isinstance(value, list):
        if not value:
            fail(f"'{key}' is an empty list")
        if isinstance(action, argparse._AppendAction):
            return [part for item in value for part in (name, _scalar(item))]
        if not many:
            fail(f"'{key}' takes one value, got a list")
        return [name, *(_scalar(item) for item in value)]
    return [name, _scalar(value)]


def _scalar(value) -> str:
    """A YAML value as the command line spells it: mappings (JSON flags) as JSON, booleans as true / false."""
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
