"""The request checks without a server: booleans are not integers, ``user`` is any string,
messages say what is allowed, a JSON body too deep to parse is a 400."""

from __future__ import annotations

import json

import pytest

from fastrwa.serve.schema import Limits, RequestError, parse_completion

LIMITS = Limits(max_prompt_bytes=1000, max_tokens_limit=1000)


def refused(body) -> RequestError:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    with pytest.raises(RequestError) as info:
        parse_completion(raw, LIMITS)
    return info.value


@pytest.mark.parametrize("name, value", [
    ("best_of", True), ("n", True), ("max_tokens", True), ("seed", False), ("top_k", True),
    ("echo", 0), ("presence_penalty", False), ("frequency_penalty", False)])
def test_booleans_are_not_numbers(name, value):
    assert refused({"prompt": "a", name: value}).param == name


def test_user_is_any_string():
    for user in ("u", "someone@example.com", "", None):
        parse_completion(json.dumps({"prompt": "a", "user": user}).encode(), LIMITS)
    for user in (3, ["u"], {"id": "u"}, True):
        assert refused({"prompt": "a", "user": user}).param == "user"


def test_prompt_ids_name_the_bad_one():
    error = refused({"prompt": [104, True, 105]})
    assert error.param == "prompt" and "True" in error.message and "index 1" in error.message
    error = refused({"prompt": [104, 256]})
    assert "[0, 255]" in error.message and "256" in error.message
    assert "one prompt per request" in refused({"prompt": ["a", "b"]}).message
    assert parse_completion(b'{"prompt": [[104, 105]]}', LIMITS).prompt == b"hi"


def test_top_p_messages_give_the_range():
    for top_p in (0, -0.5, 1.5, 1e-46):
        error = refused({"prompt": "a", "top_p": top_p})
        assert error.param == "top_p" and "(0, 1]" in error.message, error.message
    assert parse_completion(b'{"prompt": "a", "top_p": 1e-3}', LIMITS).top_p == 1e-3


def test_deeply_nested_json_is_invalid_json():
    error = refused(b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}")
    assert error.status == 400 and error.code == "invalid_json" and error.param is None
