"""The JSON Schema keywords whose values are schemas (JSON Schema 2020-12 "Core" section 10, plus
draft-07's additionalItems / definitions and list-form items): the one table every walker over
a schema's subschemas reads (`grammar.without_noops`, `closed_objects`, `chat_utils._root_refs`).
Keys of none of these kinds hold data (enum, const, ...) or are unknown."""

SUBSCHEMA_KEYS = ("items", "additionalProperties", "additionalItems", "contains", "propertyNames", "not",
                  "if", "then", "else", "unevaluatedItems", "unevaluatedProperties")   # value: a schema
SUBSCHEMA_LIST_KEYS = ("items", "prefixItems", "anyOf", "oneOf", "allOf")             # a list of schemas
SUBSCHEMA_MAP_KEYS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema

# subschemas closed_objects leaves as they are: allOf's parts (see there), and those whose
# object would not be the value's (not, if / then / else, unevaluated*)
_NOT_CLOSED = frozenset({"allOf", "not", "if", "then", "else", "unevaluatedItems", "unevaluatedProperties"})


def closed_objects(schema, every_object: bool = True):
    """A copy of a JSON schema with its objects closed. every_object=True (OpenAI's `strict:
    true`): every object schema (type "object", or properties without a type) that does not
    set additionalProperties sets it to false. every_object=False (vLLM's default backend,
    xgrammar's strict_mode, which every JSON constraint gets: `grammar.grammar_text`): an
    object schema with `properties` that sets neither additionalProperties nor
    unevaluatedProperties takes no other property, and a `prefixItems` array without `items`
    no other item; an object schema without properties stays any object. Descends into
    subschemas (properties, items, anyOf / oneOf branches, $defs, ...) but not into allOf:
    closing each part would refuse what only the parts together allow."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key, value in schema.items():
        if key in _NOT_CLOSED:
            continue
        if key in SUBSCHEMA_KEYS:
            out[key] = closed_objects(value, every_object)
        elif key in SUBSCHEMA_LIST_KEYS and isinstance(value, list):
            out[key] = [closed_objects(v, every_object) for v in value]
        elif key in SUBSCHEMA_MAP_KEYS and isinstance(value, dict):
            out[key] = {name: closed_objects(v, every_object) for name, v in value.items()}
    if not every_object:
        if "properties" in schema and "unevaluatedProperties" not in schema:
            out.setdefault("additionalProperties", False)
        if "prefixItems" in schema and not {"items", "unevaluatedItems"} & schema.keys():
            out["items"] = False
        return out
    kind = schema.get("type")
    if (kind == "object" or (isinstance(kind, list) and "object" in kind)
            or (kind is None and "properties" in schema)):
        out.setdefault("additionalProperties", False)
    return out
