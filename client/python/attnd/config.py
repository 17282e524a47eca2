"""Request builders: CacheConfig, plan entries and AttentionOptions from plain Python values.

Enum fields take their short names, case-insensitive ("mla", "bf16", "hnd", "neox", "llama3",
"external", "separate_kv") or the attnd.v1 enum values. Every builder also accepts the proto
message itself and returns it unchanged.
"""
from attnd.tensors import dtype_enum
from attnd.v1 import attnd_pb2 as pb

_ENUM_PREFIXES = {
    "kind": (pb.AttentionKind, "ATTENTION_KIND_"),
    "layout": (pb.KvLayout, "KV_LAYOUT_"),
    "page_table_mode": (pb.PageTableMode, "PAGE_TABLE_MODE_"),
    "page_table_form": (pb.PageTableForm, "PAGE_TABLE_FORM_"),
    "style": (pb.RopeStyle, "ROPE_STYLE_"),
    "scaling": (pb.RopeScaling, "ROPE_SCALING_"),
    "channel_kind": (pb.ChannelKind, "CHANNEL_KIND_"),
}


def enum_value(field, value):
    """The enum number of `value` (a short name such as "mla", or the number) for `field`."""
    if isinstance(value, int):
        return value
    enum, prefix = _ENUM_PREFIXES[field]
    name = prefix + str(value).upper()
    try:
        return enum.Value(name)
    except ValueError:
        choices = [n[len(prefix):].lower() for n in enum.keys() if not n.endswith("UNSPECIFIED")]
        raise ValueError(f"{field}: expected one of {choices}, got {value!r}") from None


def rope_config(rope):
    """RopeConfig from a dict such as {"style": "neox", "theta": 500000, "scaling": "llama3",
    "factor": 8, ...}, a RopeConfig, or None (no rope)."""
    if rope is None or isinstance(rope, pb.RopeConfig):
        return rope
    fields = dict(rope)
    for key in ("style", "scaling"):
        if key in fields:
            fields[key] = enum_value(key, fields[key])
    return pb.RopeConfig(**fields)


def cache_config(config=None, **fields):
    """CacheConfig from keyword arguments named as its fields, e.g.
    cache_config(num_layers=4, num_qo_heads=16, num_kv_heads=4, head_dim=64, q_dtype="bf16",
                 num_pages=1024, rope={"style": "neox", "theta": 10000})."""
    if config is not None:
        if fields:
            raise ValueError("pass a CacheConfig or keyword fields, not both")
        return config
    for key in ("kind", "layout", "page_table_mode", "page_table_form"):
        if key in fields:
            fields[key] = enum_value(key, fields[key])
    for key in ("q_dtype", "kv_dtype"):
        if key in fields:
            fields[key] = dtype_enum(fields[key])
    if "rope" in fields:
        fields["rope"] = rope_config(fields["rope"])
    return pb.CacheConfig(**fields)


def plan_entry(entry):
    """PlanEntry from (sequence_id, num_new_tokens), a dict with those keys (plus page_ids,
    v_page_ids and kv_len for EXTERNAL caches), or a PlanEntry."""
    if isinstance(entry, pb.PlanEntry):
        return entry
    if isinstance(entry, dict):
        fields = dict(entry)
        pages = {key: fields.pop(key) for key in ("page_ids", "v_page_ids", "kv_len")
                 if key in fields}
        message = pb.PlanEntry(**fields)
        if pages:
            message.pages.CopyFrom(pb.ExternalPages(**pages))
        return message
    sequence_id, num_new_tokens = entry
    return pb.PlanEntry(sequence_id=int(sequence_id), num_new_tokens=int(num_new_tokens))


def attention_options(options=None, **fields):
    """AttentionOptions from keyword arguments (causal, sm_scale, logits_soft_cap, window_left,
    return_lse, deterministic, fixed_split_size, disable_split_kv), a dict, or the message."""
    if isinstance(options, pb.AttentionOptions):
        return options
    merged = dict(options or {})
    merged.update(fields)
    return pb.AttentionOptions(**merged)


def plan_request(cache, entries, options=None, channel=None):
    channel_id = getattr(channel, "channel_id", channel) or 0
    return pb.PlanRequest(cache=cache, entries=[plan_entry(e) for e in entries],
                          options=attention_options(options), channel_id=int(channel_id))
