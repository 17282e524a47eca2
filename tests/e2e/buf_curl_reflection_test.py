#!/usr/bin/env python3
"""A real reflection client, `buf curl` (npm @bufbuild/buf), against the built attnd: lists the
services through reflection v1alpha, describes attnd.v1.AttentionService and
grpc.health.v1.Health from the descriptors the server serves (checked against proto/ as buf
compiles it), and calls GetServerInfo, Health/Check and CreateCache + Plan + Forward written
as JSON with float `values`, checking o against attention computed here."""
import base64
import json
import math
import os
import struct

import e2e_lib
from e2e_lib import REPO, Attnd, Buf, Failure, check, passed

# --- a minimal protobuf reader for the FileDescriptorProtos reflection returns ----------------


def _varint(data, pos):
    result, shift = 0, 0
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _fields(data):
    """Yields (field_number, value) of a serialized message; value is int or bytes."""
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, pos = _varint(data, pos)
        elif wire_type == 2:
            length, pos = _varint(data, pos)
            value, pos = data[pos:pos + length], pos + length
        elif wire_type == 1:
            value, pos = data[pos:pos + 8], pos + 8
        elif wire_type == 5:
            value, pos = data[pos:pos + 4], pos + 4
        else:
            raise Failure(f"descriptor: unexpected wire type {wire_type}")
        yield number, value


def describe_file(serialized):
    """FileDescriptorProto -> {package, services: {name: [(method, in, out, cs, ss)]},
    messages: {full name: [(field, number)]}} (field numbers of descriptor.proto)."""
    package, services, messages = "", {}, {}
    raw_messages, raw_services = [], []
    for number, value in _fields(serialized):
        if number == 2:
            package = value.decode()
        elif number == 4:
            raw_messages.append(value)
        elif number == 6:
            raw_services.append(value)

    def add_message(raw, prefix):
        name, fields, nested = "", [], []
        for number, value in _fields(raw):
            if number == 1:
                name = value.decode()
            elif number == 2:
                field = dict(_fields(value))
                fields.append((field[1].decode(), field[3]))
            elif number == 3:
                nested.append(value)
        full = f"{prefix}.{name}"
        messages[full] = sorted(fields, key=lambda f: f[1])
        for raw_nested in nested:
            add_message(raw_nested, full)

    for raw in raw_messages:
        add_message(raw, package)
    for raw in raw_services:
        name, methods = "", []
        for number, value in _fields(raw):
            if number == 1:
                name = value.decode()
            elif number == 2:
                method = dict(_fields(value))
                methods.append((method[1].decode(), method[2].decode().lstrip("."),
                                method[3].decode().lstrip("."), bool(method.get(5, 0)),
                                bool(method.get(6, 0))))
        services[f"{package}.{name}"] = methods
    return {"package": package, "services": services, "messages": messages}


def served_descriptor(buf, url, symbol):
    """The file defining `symbol`, as the server's reflection service returns it."""
    reply = buf.curl(f"{url}/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                     {"file_containing_symbol": symbol})
    files = reply.get("fileDescriptorResponse", {}).get("fileDescriptorProto", [])
    check(files, f"reflection returned no file for {symbol}: {reply}")
    described = [describe_file(base64.b64decode(f)) for f in files]
    merged = {"services": {}, "messages": {}}
    for d in described:
        merged["services"].update(d["services"])
        merged["messages"].update(d["messages"])
    return merged


def source_descriptor(buf, work_dir):
    """proto/ compiled by buf into a FileDescriptorSet (the source of truth)."""
    image = os.path.join(work_dir, "image.binpb")
    buf.run("build", os.path.join(REPO, "proto"), "--exclude-source-info", "-o", image)
    merged = {"services": {}, "messages": {}}
    with open(image, "rb") as f:
        for number, value in _fields(f.read()):
            if number == 1:
                d = describe_file(value)
                merged["services"].update(d["services"])
                merged["messages"].update(d["messages"])
    return merged


# --- attention computed here, to check what came back --------------------------------------------


def to_fp16(x):
    return struct.unpack("<e", struct.pack("<e", x))[0]


def reference_attention(q_rows, keys, values, num_qo_heads, num_kv_heads, head_dim, kv_len,
                        q_len):
    """Causal (bottom-right) attention of q_len new rows over kv_len keys of one sequence.
    q_rows[t][h][d]; keys/values[pos][kv_head][d]."""
    group = num_qo_heads // num_kv_heads
    scale = 1.0 / math.sqrt(head_dim)
    out = []
    for t in range(q_len):
        visible = kv_len - q_len + t + 1
        row = []
        for h in range(num_qo_heads):
            kv_head = h // group
            scores = [scale * sum(q_rows[t][h][d] * keys[p][kv_head][d] for d in range(head_dim))
                      for p in range(visible)]
            top = max(scores)
            weights = [math.exp(s - top) for s in scores]
            total = sum(weights)
            row.append([sum(weights[p] * values[p][kv_head][d] for p in range(visible)) / total
                        for d in range(head_dim)])
        out.append(row)
    return out


def tensor_values(rows, heads, dim, seed):
    """Deterministic fp16-representable numbers in about [-1, 1]."""
    return [[[to_fp16(math.sin(seed * 7.13 + t * 1.7 + h * 0.61 + d * 0.37))
              for d in range(dim)] for h in range(heads)] for t in range(rows)]


def flat(nested):
    return [x for row in nested for head in row for x in head]


def decode_tensor(tensor, expected_shape, expected_dtype):
    shape = [int(s) for s in tensor.get("shape", [])]
    check(shape == expected_shape, f"o shape {shape}, expected {expected_shape}")
    check(tensor.get("dtype") == expected_dtype, f"o dtype {tensor.get('dtype')}, expected "
                                                 f"{expected_dtype}")
    data = base64.b64decode(tensor.get("data", ""))
    count = math.prod(expected_shape)
    check(len(data) == 2 * count, f"o data has {len(data)} bytes, expected {2 * count}")
    return list(struct.unpack(f"<{count}e", data))


# --- the test --------------------------------------------------------------------------------

SERVICE = "attnd.v1.AttentionService"
HEALTH = "grpc.health.v1.Health"
REFLECTION = "grpc.reflection.v1alpha.ServerReflection"


def test(work_dir):
    args = e2e_lib.parse_args()
    buf = Buf(args.tools)
    attnd = Attnd(args.attnd, args.attnctl, work_dir,
                  ["--backend=cpu", "--kv_memory_bytes=268435456"]).start()
    url = f"http://{attnd.address}"

    listed = buf.run("curl", "--http2-prior-knowledge", "--protocol", "grpc",
                     "--reflect-protocol", "grpc-v1alpha", "--list-services", url).stdout.split()
    check(sorted(listed) == sorted([SERVICE, HEALTH, REFLECTION]),
          f"services listed through reflection: {listed}, expected {SERVICE}, {HEALTH}, "
          f"{REFLECTION}")
    passed(f"buf curl --list-services (reflection v1alpha): {listed}")

    source = source_descriptor(buf, work_dir)
    # --list-methods takes the base URL and lists every service's methods.
    all_methods = buf.run("curl", "--http2-prior-knowledge", "--protocol", "grpc",
                          "--reflect-protocol", "grpc-v1alpha", "--list-methods",
                          url).stdout.split()
    for service in (SERVICE, HEALTH):
        methods = sorted(m for m in all_methods if m.startswith(f"{service}/"))
        expected = sorted(f"{service}/{m[0]}" for m in source["services"][service])
        check(methods == expected, f"--list-methods for {service}: {methods}, expected "
                                   f"{expected}")
        served = served_descriptor(buf, url, service)
        check(served["services"].get(service) == source["services"][service],
              f"{service} as served: {served['services'].get(service)}\n"
              f"as in proto/: {source['services'][service]}")
        for method, request, response, client_streaming, server_streaming in \
                served["services"][service]:
            for message in (request, response):
                check(served["messages"].get(message) == source["messages"].get(message),
                      f"{message} as served: {served['messages'].get(message)}\n"
                      f"as in proto/: {source['messages'].get(message)}")
        print(f"describe {service}:")
        for method, request, response, client_streaming, server_streaming in \
                served["services"][service]:
            print(f"  rpc {method}({'stream ' if client_streaming else ''}{request}) returns "
                  f"({'stream ' if server_streaming else ''}{response})")
        passed(f"reflection describes {service} exactly as proto/ defines it "
               f"({len(served['services'][service])} methods, their messages' fields)")

    info = buf.curl(f"{url}/{SERVICE}/GetServerInfo", {})
    check(info.get("backend") == "cpu", f"GetServerInfo backend {info.get('backend')}, expected cpu")
    check(info.get("version"), f"GetServerInfo has no version: {info}")
    check(int(info.get("limits", {}).get("maxMessageBytes", 0)) > 4 << 20,
          f"GetServerInfo limits.maxMessageBytes not above gRPC's 4 MiB default: {info}")
    check(int(info.get("kvBudgetBytes", 0)) == 268435456,
          f"GetServerInfo kvBudgetBytes {info.get('kvBudgetBytes')}, expected the 268435456 "
          "given by --kv_memory_bytes")
    passed(f"GetServerInfo: version {info['version']}, backend cpu, limits {info['limits']}")

    for service in ("", SERVICE):
        health = buf.curl(f"{url}/{HEALTH}/Check", {"service": service})
        check(health.get("status") == "SERVING", f"Health/Check '{service}': {health}")
    unknown = buf.curl(f"{url}/{HEALTH}/Check", {"service": "no.such.Service"}, expect_ok=False)
    check(unknown.get("code") == "not_found", f"Health/Check of an unknown service: {unknown}")
    passed("Health/Check: '' and attnd.v1.AttentionService SERVING, unknown service NOT_FOUND")

    # A GQA cache, two layers; step 1 mixes a 3-token prefill and a 1-token prefill-from-empty,
    # step 2 decodes one token of sequence 1 over the keys of step 1.
    layers, qo_heads, kv_heads, dim = 2, 4, 2, 64
    created = buf.curl(f"{url}/{SERVICE}/CreateCache", {
        "name": "e2e-json", "config": {
            "numLayers": layers, "numQoHeads": qo_heads, "numKvHeads": kv_heads, "headDim": dim,
            "pageSize": 2, "qDtype": "DTYPE_FLOAT16", "numPages": "32"}})
    cache = created.get("cache", {})
    check(cache.get("name") == "e2e-json" and int(cache.get("numPages", 0)) == 32,
          f"CreateCache answered {created}")
    passed(f"CreateCache e2e-json: {cache.get('numPages')} pages of 2 tokens, "
           f"{cache.get('poolBytes')} pool bytes")
    again = buf.curl(f"{url}/{SERVICE}/CreateCache", {"name": "e2e-json", "config": {
        "numLayers": 1, "numQoHeads": 1, "numKvHeads": 1, "headDim": 64, "numPages": "1"}},
        expect_ok=False)
    check(again.get("code") == "already_exists", f"a second CreateCache e2e-json: {again}")

    kv_history = {1: [[] for _ in range(layers)], 2: [[] for _ in range(layers)]}
    steps = [[(1, 3), (2, 1)], [(1, 1), (2, 0)]]
    for step_number, entries in enumerate(steps):
        plan = buf.curl(f"{url}/{SERVICE}/Plan", {"cache": "e2e-json", "entries": [
            {"sequenceId": str(seq), "numNewTokens": n} for seq, n in entries]})
        num_tokens = sum(n for _, n in entries)
        check(int(plan.get("numTokens", 0)) == num_tokens and plan.get("stepId"),
              f"Plan answered {plan}, expected numTokens {num_tokens}")
        for layer in range(layers):
            seed = 10 * step_number + layer
            q = tensor_values(num_tokens, qo_heads, dim, seed + 1)
            k = tensor_values(num_tokens, kv_heads, dim, seed + 2)
            v = tensor_values(num_tokens, kv_heads, dim, seed + 3)
            reply = buf.curl(f"{url}/{SERVICE}/Forward", {
                "stepId": plan["stepId"], "layer": layer,
                "q": {"dtype": "DTYPE_FLOAT16", "shape": [num_tokens, qo_heads, dim],
                      "values": flat(q)},
                "k": {"dtype": "DTYPE_FLOAT16", "shape": [num_tokens, kv_heads, dim],
                      "values": flat(k)},
                "v": {"dtype": "DTYPE_FLOAT16", "shape": [num_tokens, kv_heads, dim],
                      "values": flat(v)}})
            o = decode_tensor(reply.get("o", {}), [num_tokens, qo_heads, dim], "DTYPE_FLOAT16")
            check(all(math.isfinite(x) for x in o), "o has non-finite numbers")
            expected, row = [], 0
            for seq, n in entries:
                history = kv_history[seq][layer]
                history += [(k[row + t], v[row + t]) for t in range(n)]
                if n:
                    expected += reference_attention(q[row:row + n], [kv[0] for kv in history],
                                                    [kv[1] for kv in history], qo_heads, kv_heads,
                                                    dim, len(history), n)
                row += n
            worst = max(abs(a - b) for a, b in zip(o, flat(expected)))
            check(worst < 2e-2, f"step {step_number} layer {layer}: o differs from attention "
                                f"computed here by up to {worst}")
            committed = reply.get("stepCommitted", False)
            check(committed == (layer == layers - 1),
                  f"stepCommitted {committed} after layer {layer} of {layers}")
        passed(f"step {step_number + 1} ({plan.get('kernel')}): Plan {entries} + Forward of "
               f"{layers} layers with JSON values; o [{num_tokens}, {qo_heads}, {dim}] fp16, "
               f"finite, matches attention computed here (max |diff| {worst:.2e}); committed")

    got = buf.curl(f"{url}/{SERVICE}/GetCache", {"name": "e2e-json"})
    check(int(got["cache"].get("numSequences", 0)) == 2 and int(got["cache"].get("usedPages", 0))
          == 3, f"after the steps GetCache says {got}, expected 2 sequences on 3 pages (5 tokens "
                "in pages of 2: 4 + 1)")
    missing = buf.curl(f"{url}/{SERVICE}/Plan", {"cache": "no-such-cache", "entries": [
        {"sequenceId": "1", "numNewTokens": 1}]}, expect_ok=False)
    check(missing.get("code") == "not_found" and "cache" in missing.get("message", ""),
          f"Plan on a missing cache: {missing}")
    bad = buf.curl(f"{url}/{SERVICE}/Forward", {"stepId": "999999", "layer": 0}, expect_ok=False)
    check(bad.get("code") in ("not_found", "invalid_argument", "failed_precondition"),
          f"Forward of an unknown step: {bad}")
    passed(f"errors come back as gRPC codes: {missing['code']}, {bad['code']}")
    buf.curl(f"{url}/{SERVICE}/DeleteCache", {"name": "e2e-json"})
    listed = buf.curl(f"{url}/{SERVICE}/ListCaches", {})
    check(not listed.get("caches"), f"ListCaches after DeleteCache: {listed}")
    passed("DeleteCache, then ListCaches is empty")
    check(attnd.stop() == 0, "attnd did not exit 0 on SIGTERM")


if __name__ == "__main__":
    e2e_lib.main(test)
