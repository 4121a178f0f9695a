"""The config: strict, with errors that name the dotted key, the value and the valid set."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.cli import main
from proxy.config import ConfigError, load_config, parse_config

EXAMPLE = Path(__file__).parent.parent / "config" / "slotwise.toml"


def test_defaults_are_usable() -> None:
    config = parse_config({})
    assert config.listen.host == "127.0.0.1"
    assert config.lora.mode == "passthrough" and config.prefill.mode == "off"


@pytest.mark.parametrize(("data", "message"), [
    ({"prefill": {"mode": "chunks"}},
     "prefill.mode: unknown mode 'chunks' (valid: off, defer, chunk)"),
    ({"listen": {"prot": 1}}, "listen.prot: unknown key (valid: host, port, max_body_mb"),
    ({"bogus": {}}, "bogus: unknown key"),
    ({"listen": {"port": "80"}}, "listen.port: expected a whole number, got '80'"),
    ({"listen": {"port": 70000}}, "listen.port: 70000 is out of range"),
    ({"upstream": {"url": "localhost:8080"}}, "upstream.url: 'localhost:8080' is not an http(s) URL"),
    ({"lora": {"mode": "fixed"}}, "lora.adapters: mode 'fixed' needs at least one adapter"),
    ({"lora": {"mode": "fixed", "adapters": [{"name": "a.gguf", "id": 1}]}},
     "lora.adapters[0]: give exactly one of 'name'"),
    ({"lora": {"adapters": [{"name": "a.gguf", "scale": "high"}]}},
     "lora.adapters[0].scale: expected a number, got 'high'"),
    ({"prefill": {"prefill_share": 1.5}}, "prefill.prefill_share: 1.5 is out of range"),
])
def test_bad_values_are_refused_with_the_dotted_key(data: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert message in str(info.value)


def test_the_shipped_example_is_valid() -> None:
    config = load_config(EXAMPLE)
    assert config.upstream.url.startswith("http://127.0.0.1")


def test_bad_toml_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[listen\nport = 1\n")
    with pytest.raises(ConfigError, match=r"bad\.toml: not valid TOML"):
        load_config(path)


def test_check_config_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["check-config", str(EXAMPLE)]) == 0
    assert "valid" in capsys.readouterr().out
    bad = tmp_path / "bad.toml"
    bad.write_text('[prefill]\nmode = "chunks"\n')
    assert main(["check-config", str(bad)]) == 2
    assert "prefill.mode: unknown mode 'chunks'" in capsys.readouterr().err
