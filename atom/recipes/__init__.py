"""Recipes: machine-readable claims about ATOM (a model, an engine setting, a workload,
the figures it must reach on given hardware) and the runner that checks them.

    python -m atom.recipes list
    python -m atom.recipes show smollm2-cpu-quickstart
    python -m atom.recipes run smollm2-cpu-quickstart [--out DIR]
"""
from atom.recipes.runner import (HardwareMismatch, RecipePending, detect_hardware, find_recipe,
                                 hardware_mismatch, list_recipes, recipes_dir, run_recipe)
from atom.recipes.schema import METRICS, Recipe, RecipeError, load_recipe, parse_recipe

__all__ = ["HardwareMismatch", "METRICS", "Recipe", "RecipeError", "RecipePending", "detect_hardware",
           "find_recipe", "hardware_mismatch", "list_recipes", "load_recipe", "parse_recipe", "recipes_dir",
           "run_recipe"]
