"""The cache-signing secret in the settings: required with Redis, refused when weak outside
development, and kept out of reprs, errors and the CLI's messages."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from jitserve.service.cli import commands as cli
from jitserve.service.settings import Settings

pytestmark = pytest.mark.timeout(60)

GOOD = "5b0e1c9a7d3f42e8b6a1c0d9e8f7a6b5c4d3e2f1a0b9c8d7e6f5a4b3c2d1e0f9"  # openssl rand -hex 32
REDIS = "redis://:pw-0123456789@cache:6379/0"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("REDIS_URL", "JITSERVE_REDIS_URL", "JITSERVE_CACHE_SECRET", "JITSERVE_API_KEYS",
                 "JITSERVE_ENV"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("env", ["production", "test", "development"])
def test_redis_needs_a_secret(env: str) -> None:
    """Processes on one Redis must agree; a random secret each would refuse each other's entries."""
    with pytest.raises(ValidationError, match="JITSERVE_CACHE_SECRET is not set, but REDIS_URL"):
        Settings(env=env, redis_url=REDIS)
    with pytest.raises(ValidationError, match="JITSERVE_CACHE_SECRET"):
        Settings(env=env, redis_url=REDIS, cache_secret="")
    assert Settings(env=env, redis_url=REDIS, cache_secret=GOOD).compiler_cache_secret() is not None


def test_without_redis_no_secret_is_needed() -> None:
    s = Settings()
    assert s.cache_secret is None and s.compiler_cache_secret() is None  # the compiler keeps one


@pytest.mark.parametrize("weak", [
    "changeme", "secret", "short-but-random-9f2c",                # placeholders, short
    "changemechangemechangemechangeme", "secret-secret-secret-secret-secret",  # placeholder words
    "0" * 64, "abababababababababababababababab",                 # too plain
])
def test_weak_secrets_are_refused_outside_development(monkeypatch: pytest.MonkeyPatch,
                                                      weak: str) -> None:
    monkeypatch.setenv("JITSERVE_CACHE_SECRET", weak)
    monkeypatch.setenv("REDIS_URL", REDIS)
    with pytest.raises(ValidationError, match="placeholder, too short") as raised:
        Settings()
    assert weak not in str(raised.value)
    monkeypatch.setenv("JITSERVE_ENV", "development")
    s = Settings()
    secret = s.compiler_cache_secret()
    assert secret is not None and secret.value == weak.encode()


def test_the_secret_stays_out_of_reprs_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JITSERVE_CACHE_SECRET", GOOD)
    s = Settings()
    assert GOOD not in repr(s) and GOOD not in str(s.model_dump())
    secret = s.compiler_cache_secret()
    assert secret is not None and secret.value == GOOD.encode()
    assert GOOD not in repr(secret) and secret.source == "JITSERVE_CACHE_SECRET"
    # Another setting's error (a placeholder API key) names none of the inputs.
    monkeypatch.setenv("JITSERVE_API_KEYS", "changeme")
    with pytest.raises(ValidationError, match="JITSERVE_API_KEYS") as raised:
        Settings()
    assert GOOD not in str(raised.value)


def test_serve_names_the_missing_secret(monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["serve", "--redis-url", REDIS]) == 2
    err = capsys.readouterr().err
    assert "bad configuration" in err and "JITSERVE_CACHE_SECRET" in err
    assert "pw-0123456789" not in err
