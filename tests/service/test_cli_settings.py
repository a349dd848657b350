"""The ``jitserve`` command line without a server: flags made from the settings,
``--config`` files and their precedence, warm manifests."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from pydantic import Field

from jitserve.service import settings as settings_module
from jitserve.service.calls.warming import ManifestError, load_manifest
from jitserve.service.cli import commands as cli
from jitserve.service.settings import Settings

pytestmark = pytest.mark.timeout(60)

SECRETS = ("api_keys", "admin_keys", "cache_secret", "peer_secret")


def _sub(command: str = "serve") -> argparse.ArgumentParser:
    parser = cli._parser(command)
    return parser._subparsers._group_actions[0].choices[command]  # noqa: SLF001 - argparse's own


def _flags(command: str = "serve") -> set[str]:
    return {s for action in _sub(command)._actions for s in action.option_strings}  # noqa: SLF001


def test_every_setting_but_the_secrets_has_a_flag() -> None:
    flags = _flags()
    for name in Settings.model_fields:
        flag = "--" + name.replace("_", "-")
        assert (flag in flags) == (name not in SECRETS), flag
    assert {"--no-disk-cache", "--config", "--warm"} <= flags
    assert "--warm" not in _flags("warm")  # warm takes its manifest as an argument


def test_a_new_setting_gets_a_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    class Newer(Settings):
        # The port of a protocol added later.
        grpc_port: int = Field(50051, ge=0)

    monkeypatch.setattr(settings_module, "Settings", Newer)
    args = cli._parser("serve").parse_args(["serve", "--grpc-port", "7000"])
    assert cli.load_settings(args).grpc_port == 7000
    assert "The port of a protocol added later" in _sub().format_help()


@pytest.mark.parametrize(("env", "file", "flags", "expected"), [
    ({"JITSERVE_FUTURE_TTL_S": "11"}, {}, [], 11.0),
    ({"JITSERVE_FUTURE_TTL_S": "11"}, {"future_ttl_s": 22}, [], 22.0),
    ({"JITSERVE_FUTURE_TTL_S": "11"}, {"future-ttl-s": 22}, ["--future-ttl-s", "33"], 33.0),
    ({}, {}, [], 600.0),
], ids=["env", "file-over-env", "flag-over-file", "default"])
def test_flags_over_file_over_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                          env: dict[str, str], file: dict[str, object],
                                          flags: list[str], expected: float) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    config = tmp_path / "jitserve.toml"
    config.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in file.items()))
    args = cli._parser("serve").parse_args(["serve", "--config", str(config), *flags])
    assert cli.load_settings(args).future_ttl_s == expected


def test_config_values_read_as_a_person_writes_them(tmp_path: Path) -> None:
    config = tmp_path / "conf" / "jitserve.toml"
    config.parent.mkdir()
    config.write_text('max_body_bytes = "16M"\ncache_dir = "cache"\ndisk_cache = false\n'
                      'api_keys = ["key-0123456789"]\n')
    args = cli._parser("serve").parse_args(["serve", "--config", str(config),
                                            "--l1-max-bytes", "1G"])
    settings = cli.load_settings(args)
    assert settings.max_body_bytes == 16 << 20 and settings.l1_max_bytes == 1 << 30
    assert settings.cache_dir == config.parent / "cache" and settings.disk_cache is False
    assert settings.api_keys == ("key-0123456789",)


def test_a_misspelt_key_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "jitserve.toml"
    config.write_text("futur_ttl_s = 5\n")
    assert cli.main(["serve", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "'futur_ttl_s' is not a setting" in err and "did you mean 'future_ttl_s'" in err


def test_admin_keys_must_be_api_keys(capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JITSERVE_API_KEYS", "alice-0123456789")
    monkeypatch.setenv("JITSERVE_ADMIN_KEYS", "mallory-0123456789")
    assert cli.main(["serve"]) == 2
    assert "JITSERVE_ADMIN_KEYS" in capsys.readouterr().err


def test_a_manifest_crosses_signatures_and_static_keys(tmp_path: Path) -> None:
    (tmp_path / "f.export").write_bytes(b"x")
    manifest = tmp_path / "warm.toml"
    manifest.write_text('[[programs]]\nfile = "f.export"\nstatic_keys = ["", "s"]\n'
                        'signatures = [["float32[8,3]"], [{shape = [2], dtype = "int32"}]]\n'
                        '[[programs]]\nfile = "f.export"\nformat = "jax_export"\n')
    items = load_manifest(manifest)
    assert [str(i) for i in items] == [
        "f.export(float32[8,3])", "f.export(float32[8,3]) static='s'", "f.export(int32[2])",
        "f.export(int32[2]) static='s'", "f.export(own avals)"]
    as_json = tmp_path / "warm.json"
    as_json.write_text(json.dumps({"programs": [{"file": "f.export",
                                                 "signatures": [["bfloat16[]"]]}]}))
    assert [str(i) for i in load_manifest(as_json)] == ["f.export(bfloat16[])"]


@pytest.mark.parametrize(("text", "message"), [
    ('[[programs]]\nfile = "missing.export"\n', "no program file"),
    ('[[programs]]\nfile = "f.export"\nsignatures = [["float32(8)"]]\n', "not an aval"),
    ('[[programs]]\nfile = "f.export"\nsignatures = [["complex7[8]"]]\n', "unsupported dtype"),
    ('[[programs]]\nfile = "f.export"\nshapes = []\n', "unknown keys ['shapes']"),
    ('[[programs]]\nfile = "f.export"\ncompiler_options = {xla_dump_to = "/tmp"}\n',
     "compile option 'xla_dump_to' is not allowed"),
    ('programs = 3\n', "expected a list 'programs'"),
])
def test_a_bad_manifest_says_what_is_wrong(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "f.export").write_bytes(b"x")
    manifest = tmp_path / "warm.toml"
    manifest.write_text(text)
    with pytest.raises(ManifestError, match=message.replace("[", r"\[").replace("(", r"\(")):
        load_manifest(manifest)
