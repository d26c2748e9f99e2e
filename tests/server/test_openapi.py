"""The server's OpenAPI document describes the `hidden_states` request field."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def schemas(http):
    response = http.get("/openapi.json")
    assert response.status_code == 200
    return response.json()["components"]["schemas"]


def test_hidden_states_request_schema(schemas):
    schema = schemas["HiddenStatesRequest"]
    assert schema["type"] == "object"
    assert schema.get("additionalProperties") is False  # unknown fields: 400
    assert "decoder-layer" in schema["description"]
    props = schema["properties"]
    assert set(props) == {"layers", "prompt", "output", "positions", "encoding"}
    for name, prop in props.items():
        assert prop.get("description"), f"{name} has no description"
    assert props["prompt"]["type"] == "boolean" and props["prompt"]["default"] is True
    assert props["output"]["type"] == "boolean" and props["output"]["default"] is True
    assert props["encoding"]["enum"] == ["base64", "float", "ref"]
    assert "url" in props["encoding"]["description"]
    assert props["encoding"]["default"] == "base64"
    layer_kinds = props["layers"]["anyOf"]
    assert {"type": "null"} in layer_kinds
    (array,) = [kind for kind in layer_kinds if kind.get("type") == "array"]
    assert {item["type"] for item in array["items"]["anyOf"]} == {"integer", "string"}
    assert "final_norm" in props["layers"]["description"]
    position_kinds = props["positions"]["anyOf"]
    assert {"type": "null"} in position_kinds
    assert {"const": "last", "type": "string"} in position_kinds
    (windows,) = [kind for kind in position_kinds if kind.get("type") == "array"]
    assert windows["items"]["type"] == "array"  # [start, end) pairs
    assert windows["items"]["prefixItems"] == [{"type": "integer"}] * 2


@pytest.mark.parametrize(
    "request_schema", ["CompletionRequest", "ChatCompletionRequest"]
)
def test_requests_reference_it(schemas, request_schema):
    field = schemas[request_schema]["properties"]["hidden_states"]
    refs = [kind.get("$ref") for kind in field["anyOf"]]
    assert "#/components/schemas/HiddenStatesRequest" in refs
    assert {"type": "null"} in field["anyOf"]
    assert "--hidden-states-config" in field["description"]


def test_routes_take_those_requests(http):
    paths = http.get("/openapi.json").json()["paths"]
    for path, schema in (
        ("/v1/completions", "CompletionRequest"),
        ("/v1/chat/completions", "ChatCompletionRequest"),
    ):
        body = paths[path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"]["$ref"].endswith(f"/{schema}")


def test_reference_routes(http):
    paths = http.get("/openapi.json").json()["paths"]
    assert set(paths["/v1/hidden_states/{ref_id}"]) == {"get", "delete"}
