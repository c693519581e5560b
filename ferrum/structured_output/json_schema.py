"""The JSON Schema keywords whose values are schemas (JSON Schema 2020-12 "Core" section 10, plus
draft-07's additionalItems / definitions and list-form items): the one table every walker over
a schema's subschemas reads (`grammar.without_noops`, `chat_utils.closed_objects` /
`_root_refs`). Keys of none of these kinds hold data (enum, const, ...) or are unknown."""

SUBSCHEMA_KEYS = ("items", "additionalProperties", "additionalItems", "contains", "propertyNames", "not",
                  "if", "then", "else", "unevaluatedItems", "unevaluatedProperties")   # value: a schema
SUBSCHEMA_LIST_KEYS = ("items", "prefixItems", "anyOf", "oneOf", "allOf")             # a list of schemas
SUBSCHEMA_MAP_KEYS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name -> schema
