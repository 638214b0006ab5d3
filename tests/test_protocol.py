"""Wire types: round trips, packed arrays, limits checked before and after decoding."""

import msgspec
import pytest

from rollq import protocol as p
from rollq.protocol import GroupResult, InvalidInput, Sample, Sampling, WorkItem


def item(**changes) -> WorkItem:
    base = WorkItem("job-1", 0, p.pack_tokens([1, 2, 3]), 4, Sampling(max_tokens=8), 1.0)
    return msgspec.structs.replace(base, **changes)


def test_token_ids_travel_packed_as_int32():
    ids = [0, 1, 2**31 - 1, 65_000]
    packed = p.pack_tokens(ids)
    assert packed == b"".join(i.to_bytes(4, "little") for i in ids)
    assert p.unpack_tokens(packed) == ids
    encoded = p.encode(item(prompt=p.pack_tokens(range(512))))
    assert len(encoded) < 512 * 4 + 140  # no per-token msgpack overhead (~130 bytes of fixed fields)


def test_work_item_and_result_round_trip():
    it = item(sampling=Sampling(temperature=0.7, stop_token_ids=[5], seed=3, regex="a+",
                                extra={"ignore_eos": True}))
    assert p.decode_item(p.encode(it)) == it
    result = GroupResult("job-1", 2, "ok", samples=[
        Sample(p.pack_tokens([4, 5]), p.pack_floats([-0.5, -1.25]), "length", versions=[(3, 0)])])
    back = p.decode_result(p.encode(result))
    assert back == result
    assert back.samples[0].token_ids == [4, 5]
    assert back.samples[0].token_logprobs == [-0.5, -1.25]


def test_new_fields_at_the_end_keep_old_messages_decodable():
    old = msgspec.msgpack.encode(["job-1", 0, p.pack_tokens([1]), 2, [], 1.0])  # no deadline
    assert p.decode_item(old).deadline == 0.0


@pytest.mark.parametrize("changes, field, limit", [
    (dict(n=0), "n", "between 1 and 1024"),
    (dict(n=5000), "n", "between 1 and 1024"),
    (dict(prompt=b""), "prompt", "at least one token"),
    (dict(prompt=p.pack_tokens([1] * (p.MAX_PROMPT_TOKENS + 1))), "prompt", "the limit is 131072"),
    (dict(prompt=b"\x01\x02\x03"), "prompt", "multiple of 4"),
    (dict(prompt=p.pack_tokens([-3])), "prompt", "non-negative"),
    (dict(sampling=Sampling(max_tokens=0)), "sampling.max_tokens", "between 1 and 131072"),
    (dict(sampling=Sampling(temperature=-1.0)), "sampling.temperature", "[0.0, 100.0]"),
    (dict(sampling=Sampling(top_p=0.0)), "sampling.top_p", "(0, 1]"),
    (dict(sampling=Sampling(logprobs=21)), "sampling.logprobs", "between 0 and 20"),
    (dict(n=1024, sampling=Sampling(max_tokens=10_000)), "sampling.max_tokens", "exceeds 4194304"),
    (dict(job_id="a b"), "job_id", "letters, digits"),
])
def test_validation_names_field_and_limit(changes, field, limit):
    with pytest.raises(InvalidInput) as e:
        p.validate_item(item(**changes))
    assert e.value.field == field
    assert limit in str(e.value)


def test_groups_of_one_job_skip_only_the_checks_that_passed(monkeypatch):
    """The shared fields' checks are skipped for a job's next group only when those fields are
    what passed, byte for byte: a type, a mutation or a group's own field is still checked."""
    checked, validate_sampling = [], p.validate_sampling

    def counted(sampling, n, *args):
        checked.append(sampling)
        validate_sampling(sampling, n, *args)

    monkeypatch.setattr(p, "validate_sampling", counted)
    p.validate_item(item(sampling=Sampling(extra={"ignore_eos": True})))
    p.validate_item(item(group_index=1, sampling=Sampling(extra={"ignore_eos": True})))
    assert len(checked) == 1  # the second group's sampling was not checked again
    with pytest.raises(InvalidInput) as e:
        p.validate_item(item(group_index=2, sampling=Sampling(extra={"ignore_eos": 1})))
    assert e.value.field == "sampling.extra.ignore_eos"
    monkeypatch.undo()
    shared = Sampling(max_tokens=8)
    p.validate_item(item(sampling=shared))
    shared.max_tokens = 0
    with pytest.raises(InvalidInput, match="max_tokens=0"):
        p.validate_item(item(group_index=1, sampling=shared))
    p.validate_item(item(n=1))
    with pytest.raises(InvalidInput, match="n=True"):
        p.validate_item(item(n=True))
    for changes, field in [(dict(prompt=p.pack_tokens([-3])), "prompt"),
                           (dict(group_index=-1), "group_index"), (dict(images=["x"]), "images[0]")]:
        p.validate_item(item())
        with pytest.raises(InvalidInput) as e:
            p.validate_item(item(**changes))
        assert e.value.field == field


def test_oversized_payload_is_refused_before_decoding():
    with pytest.raises(InvalidInput, match=f"the limit is {p.MAX_ITEM_BYTES}"):
        p.decode_item(b"\x00" * (p.MAX_ITEM_BYTES + 1))


def test_decode_errors_name_fields_not_positions():
    bad = msgspec.msgpack.encode(["job-1", 0, p.pack_tokens([1]), 2,
                                  [1.0, 1.0, 0, 0.0, 1.0, 0.0, 0.0, "many"], 1.0])
    with pytest.raises(InvalidInput, match=r"at `\$\.sampling\.max_tokens`"):
        p.decode_item(bad)
    with pytest.raises(InvalidInput, match="malformed work item"):
        p.decode_item(b"\xc1 not msgpack")


def test_user_sampling_dicts_are_checked_by_name():
    assert p.sampling_from_dict({"max_tokens": 3}).max_tokens == 3
    with pytest.raises(InvalidInput, match="unknown field `max_new_tokens`"):
        p.sampling_from_dict({"max_new_tokens": 3})
    with pytest.raises(InvalidInput, match="at `sampling.temperature`"):
        p.sampling_from_dict({"temperature": "hot"})


def _built(path: str, value) -> WorkItem:
    """A valid chat item with one field (`n`, `sampling.top_p`, `chat.messages`) set to `value`."""
    base = item(prompt=b"", chat=p.Chat([{"role": "user", "content": "hi"}]))
    *parent, name = path.split(".")
    if not parent:
        return msgspec.structs.replace(base, **{name: value})
    inner = msgspec.structs.replace(getattr(base, parent[0]), **{name: value})
    return msgspec.structs.replace(base, **{parent[0]: inner})


@pytest.mark.parametrize("path, value, field, words", [
    ("n", 1025, "n", "n=1025 must be an integer between 1 and 1024"),
    ("n", True, "n", "n=True must be an integer between 1 and 1024"),
    ("group_index", p.MAX_JOB_GROUPS, "group_index", "between 0 and 65535"),
    ("min_version", -1, "min_version", "min_version=-1 must be an integer between 0 and"),
    ("images", ["a" * 64] * (p.MAX_IMAGES + 1), "images", f"has 17 items; the limit is {p.MAX_IMAGES}"),
    ("images", ["A" * 64], "images[0]", "must be a BLAKE3 digest: 64 lowercase hex digits"),
    ("images", ["a" * 64 + "\n"], "images[0]", "BLAKE3 digest"),
    ("sampling.max_tokens", 10**9, "sampling.max_tokens", "max_tokens=1000000000 must be an integer "
                                                          "between 1 and 131072"),
    ("sampling.top_p", 0.0, "sampling.top_p", "top_p=0.0 must be a number in (0, 1]"),
    ("sampling.temperature", float("nan"), "sampling.temperature", "must be a number in [0.0, 100.0]"),
    ("sampling.stop_token_ids", [1, 2**31], "sampling.stop_token_ids[1]", "between 0 and 2147483647"),
    ("sampling.stop", ["x"] * (p.MAX_STOP_STRINGS + 1), "sampling.stop", "the limit is 64"),
    ("sampling.seed", -1, "sampling.seed", "seed=-1 must be an integer between 0 and"),
    ("sampling.regex", "a" * (p.MAX_REGEX_CHARS + 1), "sampling.regex",
     "has 4097 characters; the limit is 4096"),
    ("chat.messages", [], "chat.messages", "is empty; it needs at least 1"),
    ("chat.tools", [{}] * (p.MAX_CHAT_TOOLS + 1), "chat.tools", "the limit is 256"),
])
def test_limits_as_field_types_name_the_field_and_the_limit(path, value, field, words):
    """A limit msgspec checks as it decodes is said as the checks in code say theirs, naming the
    field (not msgspec's `Expected `int` <= 1024 - at `$[3]``): on the wire, and for an item
    built in Python (checked as a worker decodes it)."""
    with pytest.raises(InvalidInput) as e:
        p.decode_item(p.encode(_built(path, value)))
    assert e.value.field == field and words in str(e.value)
    with pytest.raises(InvalidInput) as built:
        p.validate_item(_built(path, value))
    assert (built.value.field, str(built.value)) == (e.value.field, str(e.value))


def test_values_given_whole_are_named_whatever_they_are():
    for n, words in [(0, "n=0 must"), ("3", "n='3' must"), (None, "n=None must")]:
        with pytest.raises(InvalidInput, match=f"^n: {words} be an integer between 1 and 1024$"):
            p.validate_n(n)
    with pytest.raises(InvalidInput) as e:
        p.VersionWindow(max_staleness=-1).resolve()
    assert e.value.field == "max_staleness"
    assert "max_staleness=-1 must be an integer between 0 and" in str(e.value)
    with pytest.raises(InvalidInput) as e:
        p.validate_chat(p.Chat([{"role": "user"}] * (p.MAX_CHAT_MESSAGES + 1)), "conversations[2]")
    assert e.value.field == "conversations[2].messages" and "the limit is 4096" in str(e.value)


def test_a_logit_bias_over_its_cap_is_refused_as_it_decodes_on_every_route():
    """Issue 43, item 7b: a `logit_bias` of more than MAX_LOGIT_BIAS token ids is refused by the
    decoder itself (msgpack from its length, before any entry is read), naming the field and the
    limit, never walked in Python first; it failed before (the types took any length)."""
    from rollq.gateway.chat import ChatCompletionRequest
    from rollq.gateway.completions import CompletionRequest
    from rollq.gateway.generate import GenerateRequest

    over = {str(t): 1.0 for t in range(p.MAX_LOGIT_BIAS + 1)}
    bodies = [
        (CompletionRequest, {"model": "a", "prompt": "hi", "logit_bias": over}, "$.logit_bias"),
        (ChatCompletionRequest, {"model": "a", "messages": [], "logit_bias": over}, "$.logit_bias"),
        (GenerateRequest, {"token_ids": [1], "sampling_params": {"logit_bias": over}},
         "$.sampling_params.logit_bias"),
    ]
    for cls, body, at in bodies:
        for codec in (msgspec.json, msgspec.msgpack):
            with pytest.raises(msgspec.ValidationError) as refused:
                codec.decode(codec.encode(body), type=cls)
            assert str(refused.value) == f"Expected `object` of length <= {p.MAX_LOGIT_BIAS} - at `{at}`"
        del over[str(p.MAX_LOGIT_BIAS)]  # at the cap: accepted
        codec.decode(codec.encode(body), type=cls)
        over[str(p.MAX_LOGIT_BIAS)] = 1.0
    # The SDK's and the submit route's sampling settings, and a work item from Redis.
    with pytest.raises(InvalidInput, match="sampling.logit_bias: has 4097 entries; the limit is 4096"):
        p.as_sampling({"logit_bias": {t: 1.0 for t in range(p.MAX_LOGIT_BIAS + 1)}})
    raw = p.encode(item()).replace(p.encode(Sampling(max_tokens=8)), p.encode(
        Sampling(max_tokens=8, logit_bias={t: 1.0 for t in range(p.MAX_LOGIT_BIAS + 1)})))
    with pytest.raises(InvalidInput, match="logit_bias.*the limit is 4096"):
        p.decode_item(raw)
