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
