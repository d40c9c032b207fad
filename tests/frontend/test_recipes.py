"""Model recipes and the choice of parsers and thinking budget: which source wins, how shipped
recipes match checkpoints, and the errors a bad recipe gives. No downloads: checkpoints are
tmp dirs holding a config.json (and sometimes a MODEL.toml)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from metrale.frontend.parser_selection import (
    BehaviorChoice,
    behavior_sources,
    choose_behavior,
)
from metrale.recipes import (
    Behavior,
    Checkpoint,
    Recipe,
    RecipeError,
    checkpoint_recipe,
    match_recipe,
    parse_recipe,
    repo_id_of,
    shipped_recipes,
)

HERMES_TEMPLATE = "<tool_call>\n{{ tool_call | tojson }}\n</tool_call>"
QWEN3_CODER_TEMPLATE = "<tool_call>\n<function={{ name }}>\n</function>\n</tool_call>"
MISTRAL_TEMPLATE = "[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS] [TOOL_CALLS]"

ARCHITECTURES = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "my_model": "MyModelForCausalLM",
}


@pytest.fixture(autouse=True)
def no_local_index(tmp_path, monkeypatch):
    """The shipped recipes alone: a local index on this machine must not change the results
    (tests/frontend/test_recipe_sync.py covers the local index)."""
    monkeypatch.setenv("METRALE_RECIPES_DIR", str(tmp_path / "no-local-index"))


def make_checkpoint(
    root: Path, model_type: str, model_toml: str | None = None, name: str = "ckpt"
) -> Path:
    model_dir = root / name
    model_dir.mkdir(parents=True)
    config = {"architectures": [ARCHITECTURES[model_type]], "model_type": model_type}
    (model_dir / "config.json").write_text(json.dumps(config))
    if model_toml is not None:
        (model_dir / "MODEL.toml").write_text(model_toml)
    return model_dir


def identity(model_dir: Path, repo_id: str | None = None) -> Checkpoint:
    config = json.loads((model_dir / "config.json").read_text())
    return Checkpoint(repo_id, config["architectures"][0], config["model_type"])


def choose(
    model_dir: Path,
    repo_id: str | None = None,
    template: str = "",
    flags: Behavior | None = None,
    recipes: list[Recipe] | None = None,
) -> BehaviorChoice:
    sources = behavior_sources(
        flags or Behavior(), model_dir, identity(model_dir, repo_id), recipes
    )
    return choose_behavior(sources, template)


def recipe(text: str, name: str = "test") -> Recipe:
    return parse_recipe(text, f"/recipes/{name}.toml", name, require_match=True)


# --- the shipped recipes ---


def test_every_shipped_recipe_loads():
    names = {r.name for r in shipped_recipes()}
    assert {"qwen3", "qwen3_coder", "qwen2_5", "llama3", "mistral", "demo"} <= names


@pytest.mark.parametrize(
    "repo_id, model_type, tool, reasoning, recipe_name",
    [
        ("Qwen/Qwen3-0.6B", "qwen3", "hermes", "qwen3", "qwen3"),
        ("Qwen/Qwen3-30B-A3B", "qwen3_moe", "hermes", "qwen3", "qwen3"),
        ("Qwen/Qwen3-4B-Instruct-2507", "qwen3", "hermes", "qwen3", "qwen3"),
        ("qwen/qwen3-8b", "qwen3", "hermes", "qwen3", "qwen3"),  # ids are case-insensitive
        ("Qwen/Qwen3-Coder-30B-A3B-Instruct", "qwen3_moe", "qwen3_coder", None, "qwen3_coder"),
        ("unsloth/Qwen3-Coder-480B-A35B-Instruct", "qwen3_moe", "qwen3_coder", None, "qwen3_coder"),
        ("Qwen/Qwen2.5-7B-Instruct", "qwen2", "hermes", None, "qwen2_5"),
        ("Qwen/Qwen2.5-Coder-7B-Instruct", "qwen2", "hermes", None, "qwen2_5"),
        ("meta-llama/Llama-3.1-8B-Instruct", "llama", "bare_json", None, "llama3"),
        ("meta-llama/Meta-Llama-3.1-8B-Instruct", "llama", "bare_json", None, "llama3"),
        ("meta-llama/Llama-3.2-1B-Instruct", "llama", "bare_json", None, "llama3"),
        ("meta-llama/Llama-3.3-70B-Instruct", "llama", "bare_json", None, "llama3"),
        ("mistralai/Mistral-7B-Instruct-v0.3", "mistral", "mistral", None, "mistral"),
        ("mistralai/Mistral-Nemo-Instruct-2407", "mistral", "mistral", None, "mistral"),
        ("metrale-demo", "qwen3", "hermes", "qwen3", "demo"),
    ],
)
def test_shipped_recipes_match_the_families_we_serve(
    tmp_path, repo_id, model_type, tool, reasoning, recipe_name
):
    choice = choose(make_checkpoint(tmp_path, model_type), repo_id)
    assert (choice.tool_call_parser, choice.reasoning_parser) == (tool, reasoning)
    label = f"recipe {recipe_name} (metrale/recipes/{recipe_name}.toml)"
    assert choice.tool_call_parser_source == label
    assert choice.reasoning_parser_source == label


def test_the_demo_checkpoint_gets_the_demo_recipe(tmp_path):
    from metrale import demo

    model_dir = make_checkpoint(tmp_path, "qwen3")
    checkpoint = Checkpoint(repo_id_of(demo.MODEL_NAME, model_dir), "Qwen3ForCausalLM", "qwen3")
    matched = match_recipe(checkpoint, shipped_recipes())
    assert matched is not None and matched.name == "demo"


# --- precedence: flag > MODEL.toml > recipe > tool_defaults.toml > chat template ---

QWEN3_RECIPE = """
[match]
repo_ids = ["Qwen/Qwen3-*"]
[behavior]
tool_call_parser = "qwen3_xml"
reasoning_parser = "deepseek_r1"
max_thinking_budget = 2048
"""


def test_the_flag_wins_over_everything(tmp_path):
    model_dir = make_checkpoint(tmp_path, "qwen3", '[behavior]\ntool_call_parser = "gemma4"\n')
    choice = choose(
        model_dir,
        "Qwen/Qwen3-8B",
        HERMES_TEMPLATE,
        flags=Behavior("mistral", "none", 100),
        recipes=[recipe(QWEN3_RECIPE)],
    )
    assert (choice.tool_call_parser, choice.reasoning_parser) == ("mistral", None)
    assert choice.max_thinking_budget == 100
    assert choice.tool_call_parser_source == "--tool-call-parser"
    assert choice.reasoning_parser_source == "--reasoning-parser"
    assert choice.max_thinking_budget_source == "--max-thinking-budget"


def test_the_checkpoints_model_toml_wins_over_the_recipe(tmp_path):
    model_dir = make_checkpoint(
        tmp_path,
        "qwen3",
        '[behavior]\ntool_call_parser = "gemma4"\nmax_thinking_budget = 512\n',
    )
    choice = choose(model_dir, "Qwen/Qwen3-8B", recipes=[recipe(QWEN3_RECIPE)])
    assert choice.tool_call_parser == "gemma4"
    assert choice.max_thinking_budget == 512
    assert choice.tool_call_parser_source == f"checkpoint's {model_dir / 'MODEL.toml'}"
    # What MODEL.toml leaves out still comes from the recipe.
    assert choice.reasoning_parser == "deepseek_r1"
    assert choice.reasoning_parser_source == "recipe test (/recipes/test.toml)"


def test_the_recipe_wins_over_tool_defaults(tmp_path):
    # tool_defaults.toml gives qwen3_moe the qwen3 reasoning parser; Qwen3-Coder does not think.
    choice = choose(make_checkpoint(tmp_path, "qwen3_moe"), "Qwen/Qwen3-Coder-30B-A3B-Instruct")
    assert choice.reasoning_parser is None
    assert choice.reasoning_parser_source == (
        "recipe qwen3_coder (metrale/recipes/qwen3_coder.toml)"
    )


def test_tool_defaults_wins_over_the_chat_template(tmp_path):
    choice = choose(make_checkpoint(tmp_path, "qwen2"), None, QWEN3_CODER_TEMPLATE)
    assert choice.tool_call_parser == "hermes"
    assert choice.tool_call_parser_source == "tool_defaults.toml, model_type qwen2"


def test_the_chat_template_decides_last(tmp_path):
    choice = choose(make_checkpoint(tmp_path, "my_model"), "someone/my-model", MISTRAL_TEMPLATE)
    assert choice.tool_call_parser == "mistral"
    assert choice.tool_call_parser_source == "chat template"
    assert (choice.reasoning_parser, choice.reasoning_parser_source) == (None, "default")
    assert (choice.max_thinking_budget, choice.max_thinking_budget_source) == (None, "default")


def test_nothing_found_means_no_parser(tmp_path):
    choice = choose(make_checkpoint(tmp_path, "my_model"), None, "{{ messages }}")
    assert choice.tool_call_parser is None
    assert choice.describe() == (
        "tool-call parser none (no format in the chat template); reasoning parser none "
        "(default); max thinking budget none (default); content-loop watchdog off (default); "
        "max inter-tool prose none (default)"
    )


def test_a_recipe_bounds_inter_tool_prose_and_the_flag_wins(tmp_path):
    model_dir = make_checkpoint(tmp_path, "my_model", "[behavior]\nmax_inter_tool_prose = 64\n")
    choice = choose(model_dir, None, "{{ messages }}")
    assert choice.max_inter_tool_prose == 64
    assert "MODEL.toml" in choice.max_inter_tool_prose_source
    off = choose(model_dir, None, "{{ messages }}", Behavior(max_inter_tool_prose=0))
    assert off.max_inter_tool_prose is None
    assert off.max_inter_tool_prose_source == "--max-inter-tool-prose"
    bad = make_checkpoint(tmp_path / "b", "my_model", "[behavior]\nmax_inter_tool_prose = -1\n")
    with pytest.raises(ValueError, match=r"max_inter_tool_prose.*not a token count"):
        choose(bad, None, "{{ messages }}")


def test_a_recipe_turns_the_loop_watchdog_on_and_the_flag_wins(tmp_path):
    model_dir = make_checkpoint(tmp_path, "my_model", "[behavior]\nenable_loop_watchdog = true\n")
    choice = choose(model_dir, None, "{{ messages }}")
    assert choice.loop_watchdog and "MODEL.toml" in choice.loop_watchdog_source
    off = choose(model_dir, None, "{{ messages }}", Behavior(enable_loop_watchdog=False))
    assert not off.loop_watchdog and off.loop_watchdog_source == "--content-loop-watchdog"
    bad = make_checkpoint(tmp_path / "b", "my_model", '[behavior]\nenable_loop_watchdog = "yes"\n')
    with pytest.raises(ValueError, match=r"enable_loop_watchdog.*not a boolean"):
        choose(bad, None, "{{ messages }}")


def test_auto_in_model_toml_reads_the_template_and_none_stops_the_search(tmp_path):
    model_dir = make_checkpoint(
        tmp_path, "qwen3", '[behavior]\ntool_call_parser = "auto"\nreasoning_parser = "none"\n'
    )
    choice = choose(model_dir, "Qwen/Qwen3-8B", QWEN3_CODER_TEMPLATE)
    assert choice.tool_call_parser == "qwen3_coder"
    assert choice.tool_call_parser_source == "chat template"
    assert choice.reasoning_parser is None


def test_the_log_line_says_where_each_choice_came_from(tmp_path):
    choice = choose(
        make_checkpoint(tmp_path, "qwen3"), "Qwen/Qwen3-8B", flags=Behavior(None, None, 64)
    )
    assert choice.describe() == (
        "tool-call parser hermes (recipe qwen3 (metrale/recipes/qwen3.toml)); reasoning parser "
        "qwen3 (recipe qwen3 (metrale/recipes/qwen3.toml)); "
        "max thinking budget 64 (--max-thinking-budget); content-loop watchdog off (default); "
        "max inter-tool prose none (default)"
    )


# --- max_thinking_budget and thinking_steering ---


def test_max_thinking_budget_comes_from_the_recipe_unless_the_flag_is_given(tmp_path):
    model_dir = make_checkpoint(tmp_path, "qwen3")
    recipes = [recipe(QWEN3_RECIPE)]
    from_recipe = choose(model_dir, "Qwen/Qwen3-8B", recipes=recipes)
    assert (from_recipe.max_thinking_budget, from_recipe.max_thinking_budget_source) == (
        2048,
        "recipe test (/recipes/test.toml)",
    )
    from_flag = choose(model_dir, "Qwen/Qwen3-8B", flags=Behavior(None, None, 300), recipes=recipes)
    assert from_flag.max_thinking_budget == 300


def test_no_thinking_steering_means_no_server_budget(tmp_path, caplog):
    model_dir = make_checkpoint(tmp_path, "qwen3", "[behavior]\nthinking_steering = false\n")
    recipes = [recipe(QWEN3_RECIPE)]
    choice = choose(model_dir, "Qwen/Qwen3-8B", recipes=recipes)
    assert choice.max_thinking_budget is None
    assert choice.max_thinking_budget_source.startswith("thinking_steering = false in checkpoint")
    with caplog.at_level(logging.WARNING):
        choice = choose(
            model_dir, "Qwen/Qwen3-8B", flags=Behavior(None, None, 300), recipes=recipes
        )
    assert choice.max_thinking_budget is None
    assert "--max-thinking-budget 300 is not applied" in caplog.text


# --- matching ---


def test_the_more_specific_glob_wins():
    general = recipe('[match]\nrepo_ids = ["Qwen/*"]\n', "general")
    specific = recipe('[match]\nrepo_ids = ["Qwen/Qwen3-*"]\n', "specific")
    checkpoint = Checkpoint("Qwen/Qwen3-8B", "Qwen3ForCausalLM", "qwen3")
    assert match_recipe(checkpoint, [general, specific]) is specific
    assert match_recipe(checkpoint, [specific, general]) is specific
    other = Checkpoint("Qwen/Qwen2-7B", "Qwen2ForCausalLM", "qwen2")
    assert match_recipe(other, [general, specific]) is general


def test_a_repo_id_match_beats_a_config_match_and_every_key_must_match():
    by_type = recipe('[match]\nmodel_types = ["qwen3"]\n', "by_type")
    by_arch = recipe(
        '[match]\narchitectures = ["Qwen3ForCausalLM"]\nmodel_types = ["qwen3"]\n', "by_arch"
    )
    by_id = recipe('[match]\nrepo_ids = ["*/Qwen3-8B"]\n', "by_id")
    narrowed = recipe('[match]\nrepo_ids = ["Qwen/*"]\nmodel_types = ["qwen2"]\n', "narrowed")
    recipes = [by_type, by_arch, by_id, narrowed]
    assert match_recipe(Checkpoint("Qwen/Qwen3-8B", "Qwen3ForCausalLM", "qwen3"), recipes) is by_id
    # With no repo id (a plain directory), the config decides; more keys are more specific.
    assert match_recipe(Checkpoint(None, "Qwen3ForCausalLM", "qwen3"), recipes) is by_arch
    assert match_recipe(Checkpoint(None, "Other", "qwen3"), recipes) is by_type
    assert match_recipe(Checkpoint("Qwen/Qwen2-7B", "Qwen2ForCausalLM", "qwen2"), recipes) is (
        narrowed
    )
    assert match_recipe(Checkpoint(None, "LlamaForCausalLM", "llama"), recipes) is None


def test_two_equally_specific_recipes_are_an_error():
    a = recipe('[match]\nrepo_ids = ["Qwen/Qwen3-*"]\n', "a")
    b = recipe('[match]\nrepo_ids = ["Qwen/Qwen3-?*"]\n', "b")
    with pytest.raises(RecipeError, match=r"/recipes/a\.toml and /recipes/b\.toml match Qwen/"):
        match_recipe(Checkpoint("Qwen/Qwen3-8B", "Qwen3ForCausalLM", "qwen3"), [a, b])


def test_repo_id_of(tmp_path):
    assert repo_id_of("Qwen/Qwen3-8B", tmp_path) == "Qwen/Qwen3-8B"
    plain = make_checkpoint(tmp_path, "qwen3")
    assert repo_id_of(str(plain), plain) is None
    assert repo_id_of(None, plain) is None
    snapshot = tmp_path / "hub" / "models--Qwen--Qwen3-0.6B" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    assert repo_id_of(str(snapshot), snapshot) == "Qwen/Qwen3-0.6B"
    assert repo_id_of(None, snapshot) == "Qwen/Qwen3-0.6B"


# --- bad recipes ---


@pytest.mark.parametrize(
    "text, message",
    [
        (
            '[behavior]\ntool_parser = "hermes"\n',
            r"MODEL\.toml \[behavior\]: unknown key tool_parser: known keys are tool_call_parser",
        ),
        (
            '[behavior]\ntool_call_parser = "hermès"\n',
            r"MODEL\.toml \[behavior\]: tool_call_parser = 'hermès' is not a known format: "
            r"use one of .*hermes.*, auto or none",
        ),
        (
            '[behavior]\nreasoning_parser = "r1"\n',
            r"reasoning_parser = 'r1' is not a known format: use one of deepseek_r1, qwen3 or none",
        ),
        ("[behavior]\nmax_thinking_budget = -1\n", r"max_thinking_budget = -1 is not a token"),
        ('[behavior]\nmax_thinking_budget = "4k"\n', r"max_thinking_budget = '4k' is not a token"),
        ("[behavior]\nthinking_steering = 1\n", r"thinking_steering = 1 is not a boolean"),
        ('[model]\nname = "x"\n', r"MODEL\.toml: unknown table or key model"),
        ("[behavior\n", r"MODEL\.toml is not valid TOML"),
        ("behavior = 3\n", r"MODEL\.toml \[behavior\] must be a table"),
        ('[match]\nrepo_ids = "Qwen/*"\n', r"\[match\]: repo_ids must be a list of strings"),
        ("[match]\n", r"\[match\]: names no checkpoints"),
        ('[match]\nrepo = ["Qwen/*"]\n', r"\[match\]: unknown key repo"),
    ],
)
def test_a_bad_model_toml_is_an_error_naming_the_file(tmp_path, text, message):
    model_dir = make_checkpoint(tmp_path, "qwen3", text)
    with pytest.raises(RecipeError, match=message) as error:
        choose(model_dir, "Qwen/Qwen3-8B")
    assert str(model_dir / "MODEL.toml") in str(error.value)


def test_a_shipped_recipe_needs_a_match_table():
    with pytest.raises(RecipeError, match=r"/recipes/x\.toml: a recipe needs a \[match\] table"):
        recipe('[behavior]\ntool_call_parser = "hermes"\n', "x")


def test_a_checkpoint_model_toml_needs_no_match_table(tmp_path):
    model_dir = make_checkpoint(tmp_path, "qwen3", '[behavior]\ntool_call_parser = "hermes"\n')
    own = checkpoint_recipe(model_dir)
    assert own is not None and own.match is None
    assert own.behavior == Behavior(tool_call_parser="hermes")
    assert checkpoint_recipe(make_checkpoint(tmp_path, "qwen3", name="bare")) is None


@pytest.mark.parametrize(
    "flags, message",
    [
        (Behavior(tool_call_parser="json"), r"--tool-call-parser 'json' is not a known format"),
        (Behavior(reasoning_parser="auto"), r"--reasoning-parser 'auto' is not a known format"),
        (Behavior(max_thinking_budget=-5), r"--max-thinking-budget -5 is not a token count"),
    ],
)
def test_a_bad_flag_is_an_error_naming_the_flag(tmp_path, flags, message):
    with pytest.raises(ValueError, match=message):
        choose(make_checkpoint(tmp_path, "qwen3"), flags=flags)


def test_sampling_presets_come_from_the_first_source_that_has_them(tmp_path):
    shipped = choose(make_checkpoint(tmp_path, "qwen3"), "Qwen/Qwen3-8B")
    assert shipped.sampling_presets is not None and "qwen3" in shipped.sampling_presets_source
    assert shipped.sampling_presets.for_turn(True) == {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "min_p": 0.0,
    }
    assert shipped.sampling_presets.for_turn(False)["top_p"] == 0.8
    own = make_checkpoint(tmp_path / "own", "qwen3", "[sampling.non_thinking]\ntemperature = 0.2\n")
    mine = choose(own, "Qwen/Qwen3-8B")
    assert "MODEL.toml" in mine.sampling_presets_source
    assert mine.sampling_presets.for_turn(True) == {}  # its table replaces the recipe's whole
    assert mine.sampling_presets.for_turn(False) == {"temperature": 0.2}
    none = choose(make_checkpoint(tmp_path / "none", "llama"))
    assert none.sampling_presets is None and none.sampling_presets_source == "none"


@pytest.mark.parametrize(
    ("table", "problem"),
    [
        ("[sampling.thinking]\nseed = 3\n", "unknown key seed"),
        ("[sampling.sometimes]\ntemperature = 1.0\n", "unknown key sometimes"),
        ("[sampling.thinking]\ntop_p = 1.5\n", "top_p=1.5 is out of range"),
        ("[sampling.thinking]\ntop_k = 2.5\n", "not an integer"),
        ("[sampling.thinking]\ndry_allowed_length = 2.5\n", "not an integer"),
        ("[sampling.non_thinking]\ndry_base = 0.5\n", "dry_base=0.5 is out of range"),
        ("[sampling.non_thinking]\nlz_penalty = -1.0\n", "lz_penalty=-1.0 is out of range"),
        ('[sampling.thinking]\ntemperature = "hot"\n', "not a number"),
        ("[sampling]\nthinking = 1\n", "must be a table"),
    ],
)
def test_bad_sampling_presets_are_errors_naming_the_file(tmp_path, table, problem):
    with pytest.raises(ValueError, match=problem):
        choose(make_checkpoint(tmp_path, "qwen3", table))
