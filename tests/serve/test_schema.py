"""The request checks without a server: booleans are not integers, ``user`` is any string,
messages say what is allowed, a JSON body too deep to parse is a 400; whatever JSON can carry
(any string, any number, any depth, null) is an answer naming the field."""

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
    assert error.param == "prompt" and "true" in error.message and "index 1" in error.message
    error = refused({"prompt": [104, 257]})
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


# -- what JSON can carry: every field, any string, any number, null as the default ----------

FIELDS = ("model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed",
          "stream", "stream_options", "n", "echo", "logprobs", "best_of", "user",
          "presence_penalty", "frequency_penalty", "logit_bias", "suffix")


def refused_raw(text: str) -> RequestError:
    """The error for a body written as JSON text (numbers and escapes exactly as given)."""
    with pytest.raises(RequestError) as info:
        parse_completion(text.encode(), LIMITS)
    assert info.value.status == 400
    json.dumps(info.value.body(), ensure_ascii=False).encode()      # (the answer can be sent)
    return info.value


@pytest.mark.parametrize("name", FIELDS)
def test_a_lone_surrogate_in_any_field_is_a_400_naming_it(name):
    for value in (r'"\ud800"', r'["\udfff"]', r'{"\ud800": 1}'):
        body = f'{{"prompt": "a", "{name}": {value}}}' if name != "prompt" \
            else f'{{"prompt": {value}}}'
        error = refused_raw(body)
        assert error.param == name, (body, error.param, error.message)
    error = refused_raw(r'{"prompt": "a", "\ud800": 1}')      # (a field's name)
    assert "\\ud800" in error.message


@pytest.mark.parametrize("name", FIELDS)
def test_numbers_json_allows_in_any_field_are_a_400_naming_it(name):
    huge = "9" * 5000                                          # (over Python's 4,300 digits)
    for value in (huge, "-" + huge, f"[{huge}]", f'{{"k": {huge}}}', "1e400", "-1e400",
                  "[1e999]", "0." + huge):
        body = f'{{"prompt": "a", "{name}": {value}}}' if name != "prompt" \
            else f'{{"prompt": {value}}}'
        if value == "0." + huge and name in ("temperature", "top_p"):
            continue                                           # (a float: 1.0 there)
        error = refused_raw(body)
        assert error.param == name, (value[:20], error.param, error.message)
        assert len(error.message) < 300, error.message


def test_json_that_is_not_json_or_too_deep_is_an_invalid_json_400():
    for text in ('{"prompt": NaN}', '{"prompt": "a", "top_p": Infinity}',
                 '{"prompt": "a", "seed": -Infinity}'):
        assert refused_raw(text).code == "invalid_json", text
    deep = '{"prompt": "a", "user": ' + "[" * 100000 + "]" * 100000 + "}"
    assert refused_raw(deep).code == "invalid_json"
    nested = '{"prompt": "a", "max_tokens": ' + "[" * 500 + "]" * 500 + "}"
    error = refused_raw(nested)                 # (parsed, then refused in one short line)
    assert error.param == "max_tokens" and len(error.message) < 300


def test_null_is_the_default_of_every_field_but_prompt():
    default = parse_completion(b'{"prompt": "a"}', LIMITS)
    for name in FIELDS:
        if name != "prompt":
            got = parse_completion(json.dumps({"prompt": "a", name: None}).encode(), LIMITS)
            assert got == default, name
    options = parse_completion(b'{"prompt": "a", "stream": true, "stream_options": '
                               b'{"include_usage": null}}', LIMITS)
    assert options.stream and not options.include_usage
    assert refused({"prompt": None}).param == "prompt"


@pytest.mark.parametrize("name", ["echo", "stream"])
def test_boolean_fields_take_json_booleans_only(name):
    for value in (0, 0.0, 1, 1.0, "false", "", [], {}):
        error = refused({"prompt": "a", name: value})
        assert error.param == name and "true, false or null" in error.message, (value, error)
    assert parse_completion(json.dumps({"prompt": "a", name: False}).encode(), LIMITS)
    for value in (0, 0.0, "true"):
        body = {"prompt": "a", "stream": True, "stream_options": {"include_usage": value}}
        assert refused(body).param == "stream_options"


@pytest.mark.parametrize("raw", [b"1e400", b"1" * 5000, b'"\\ud800"', b'["\\ud800"]'])
def test_a_body_that_is_not_an_object_is_refused_whatever_it_holds(raw):
    """A bare number beyond every range or a bare string that is not Unicode: a
    RequestError whose message encodes (it was a TypeError or an unencodable message)."""
    with pytest.raises(RequestError, match="must be a JSON object") as caught:
        parse_completion(raw, LIMITS)
    str(caught.value).encode("utf-8")


@pytest.mark.parametrize("name, value", [
    ("temperature", 3.4028234663852886e38), ("temperature", 3.4028235677973366e38),
    ("temperature", 1e-300), ("temperature", -1e-300), ("top_p", 1.4e-45), ("top_p", 7e-46),
    ("top_p", 7.1e-46), ("top_p", 1), ("top_p", 1.0000000000000002), ("top_k", 1),
    ("top_k", 10 ** 99), ("max_tokens", 0), ("max_tokens", -1)])
def test_the_sampling_fields_take_what_generate_takes(name, value):
    """The server's checks are ``generate``'s (models/sampling.py), at float32's edges too."""
    from fastrwa.models.sampling import check_sampling_args
    args = dict(max_new_tokens=0, temperature=1.0, top_k=None, top_p=None)
    args[{"max_tokens": "max_new_tokens"}.get(name, name)] = value
    try:
        check_sampling_args(**args)
        generate_takes = True
    except ValueError:
        generate_takes = False
    limits = Limits(max_prompt_bytes=10, max_tokens_limit=10 ** 100)
    try:
        parse_completion(json.dumps({"prompt": "a", name: value}).encode(), limits)
        server_takes = True
    except RequestError as exc:
        assert exc.param == name
        server_takes = False
    assert server_takes == generate_takes
