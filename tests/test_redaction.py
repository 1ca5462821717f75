"""pimm.utils.redaction: secrets never written, paths never published."""

from __future__ import annotations

import pytest

from pimm.utils.redaction import REDACTED, is_secret_key, redact_paths, redact_secrets, redact_secrets_in_text


@pytest.mark.parametrize("name", ["token", "hf_token", "HF_TOKEN", "api_key", "apikey", "API-KEY", "password",
                                  "passwd", "secret", "client_secret", "access_key", "wandb_token", "my_api_key",
                                  "db_secret", "root_password", "hooks.0.token", "secret_key", "private_key"])
def test_secret_keys(name):
    assert is_secret_key(name)


@pytest.mark.parametrize("name", ["grid_key", "keys", "key", "feat_keys", "index_valid_keys", "mask_token",
                                  "enc_mask_token", "cls_token", "num_tokens", "tokens", "exclude_token_from_wd",
                                  "secret_sauce", "password_file", "tokenizer", "", None, 3])
def test_ordinary_keys(name):
    assert not is_secret_key(name)


def test_values_under_secret_keys_are_redacted_in_a_copy():
    cfg = {"hooks": [{"type": "PushToHub", "token": "hf_live", "repo_id": "me/m"}],
           "model": {"mask_token": False, "grid_key": "grid", "api_key": None},
           "pair": ("x", {"password": "pw"})}
    out = redact_secrets(cfg)
    assert out["hooks"][0] == {"type": "PushToHub", "token": REDACTED, "repo_id": "me/m"}
    assert out["model"] == {"mask_token": False, "grid_key": "grid", "api_key": None}  # not text: kept
    assert out["pair"] == ("x", {"password": REDACTED}) and isinstance(out["pair"], tuple)
    assert cfg["hooks"][0]["token"] == "hf_live"  # the live value is untouched


def test_secrets_inside_command_lines():
    line = ("WANDB_API_KEY=abc123 HF_TOKEN='q w' MY_SECRET=s DB_PASSWORD=p GRID_SIZE=3 python train.py "
            "--token T1 --api-key=T2 --hf-token T3 --options hooks.0.token=T4 "
            "+hooks=[dict(type='PushToHub',token='T5')] --tokenizer bert https://user:T6@host/x")
    out = redact_secrets(line)
    for secret in ("abc123", "q w", "=s ", "=p ", "T1", "T2", "T3", "T4", "T5", "T6"):
        assert secret not in out, (secret, out)
    assert "GRID_SIZE=3" in out and "--tokenizer bert" in out and "python train.py" in out
    assert f"WANDB_API_KEY={REDACTED}" in out and f"HF_TOKEN='{REDACTED}'" in out
    assert redact_secrets_in_text('{"token": "abc", "mask_token": "m"}') == '{"token": "<redacted>", "mask_token": "m"}'
    assert REDACTED in redact_secrets("pushed with hf_" + "a" * 34)


def test_redaction_is_idempotent():
    once = redact_secrets({"cmd": "HF_TOKEN=x --token y", "token": "z"})
    assert redact_secrets(once) == once


def test_paths_anywhere_in_strings_and_keys():
    cfg = {"cmd": "python /home/u/pimm/train.py --config-file=/srv/c.py PYTHONPATH=/opt/a:/opt/b -o ~/runs/x "
                  "--data file:///data/x.h5 --hub hf://org/m https://example.org/a/b",
           "stats": {"/data/run1": 1, "/data/run2": 2, "train/loss": 3},
           "rel": "data/x", "ratio": "a / b", "home": "$HOME/x", "other": "~bob/y"}
    out = redact_paths(cfg)
    for leak in ("/home/u", "/srv/c.py", "/opt/a", "/opt/b", "~/runs", "/data/x.h5", "/data/run"):
        assert leak not in repr(out), (leak, out)
    assert "hf://org/m" in out["cmd"] and "https://example.org/a/b" in out["cmd"]
    assert out["cmd"].startswith(f"python {REDACTED} --config-file={REDACTED} PYTHONPATH={REDACTED}:{REDACTED}")
    assert sorted(out["stats"].values()) == [1, 2, 3] and "train/loss" in out["stats"]
    assert out["rel"] == "data/x" and out["ratio"] == "a / b"
    assert out["home"] == REDACTED and out["other"] == REDACTED
