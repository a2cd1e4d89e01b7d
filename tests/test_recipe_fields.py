"""Every field of every recipe model says what it is: the JSON schemas editors complete from
carry a description for each property, and the shipped schema files are the generated ones."""

from __future__ import annotations

import json

import pytest

from kitchen import lab, mapo, paths, sft
from kitchen.integrations.trl import TRLRecipe
from kitchen.integrations.verl import VerlSettings
from kitchen.train import recipe_schema

MODELS = {
    "Recipe": recipe_schema,
    "AdvantageConfig": mapo.schema,  # what `advantage.overrides` may set
    "TRLRecipe": lambda: TRLRecipe.model_json_schema(by_alias=True),
    "VerlSettings": lambda: VerlSettings.model_json_schema(by_alias=True),
    "LabConfig": lambda: lab.LabConfig.model_json_schema(),
    "SFTRecipe": sft.schema,
}


def undescribed(schema: dict) -> list[str]:
    """`Model.field` for every property without a description, in the schema and its $defs."""
    out = []
    for name, node in [(schema.get("title", "?"), schema), *schema.get("$defs", {}).items()]:
        for field, prop in node.get("properties", {}).items():
            if not prop.get("description"):
                out.append(f"{name}.{field}")
    return out


@pytest.mark.parametrize("name", list(MODELS))
def test_every_field_is_described(name):
    missing = undescribed(MODELS[name]())
    assert not missing, f"fields without a description: {missing}"


def test_shipped_recipe_schema_is_the_generated_one():
    """data/schema/recipe.schema.json is what `kitchen schema recipe` prints (`make schema`)."""
    shipped = json.loads((paths.DATA / "schema" / "recipe.schema.json").read_text())
    assert shipped == json.loads(json.dumps(recipe_schema())), "regenerate it: make schema"
