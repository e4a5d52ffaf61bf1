"""What the REST API's OpenAPI document says that its request models alone cannot: the body
of a submit, single or bulk, is a union discriminated by `task` with one member per
registered task, each carrying that task's own `args` schema (its pydantic model) and its
own bounds (the task's timeout and retry policy); `priority` and `resources` name the
latency classes and resources the operator has configured (read when the document is).

The document follows the registry (fairqueue.jobs.registry): the tasks of every installed
app's `fairqueue_tasks` module and of FAIRQUEUE_TASK_MODULES, and the demo's in the demo
only. The views validate a submit exactly as before (fairqueue.jobs.submission: the same
checks in the same order, the same error codes), so this module changes what the document
promises, never what a request gets.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any

from ninja import NinjaAPI
from ninja.openapi.schema import REF_TEMPLATE, OpenAPISchema
from pydantic.json_schema import models_json_schema

from fairqueue.jobs.registry import RegisteredTask, is_continuation, task_get, task_names
from tenants.models import LatencyClass, Resource

SUBMISSION = "JobSubmission"  # the union's component


@dataclass(frozen=True)
class SubmitChoices:
    """The names a submit may use that the operator configures."""

    latency_classes: list[str]
    resources: list[str]


def submit_choices() -> SubmitChoices:
    """The latency classes (highest rank first) and resources a submit may name now."""
    return SubmitChoices(
        latency_classes=list(LatencyClass.objects.order_by("-rank", "name").values_list("name", flat=True)),
        resources=list(Resource.objects.order_by("name").values_list("name", flat=True)),
    )


_REF_PREFIX = REF_TEMPLATE.format(model="")


def _ref(name: str) -> dict[str, str]:
    return {"$ref": REF_TEMPLATE.format(model=name)}


def member_name(task: str, taken: set[str]) -> str:
    """The component name of a task's member: `demo.sleep` -> `DemoSleepJob` (unique)."""
    words = [w for w in re.split(r"[^0-9A-Za-z]+", task) if w]
    base = "".join(w[:1].upper() + w[1:] for w in words) + "Job"
    name, n = base, 2
    while name in taken:
        name, n = f"{base}{n}", n + 1
    return name


def _rename_refs(node: Any, renames: dict[str, str]) -> None:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith(_REF_PREFIX) and ref[len(_REF_PREFIX) :] in renames:
            node["$ref"] = REF_TEMPLATE.format(model=renames[ref[len(_REF_PREFIX) :]])
        for value in node.values():
            _rename_refs(value, renames)
    elif isinstance(node, list):
        for value in node:
            _rename_refs(value, renames)


def _args_schemas(tasks: list[RegisteredTask], components: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each task's `args` schema (a reference), its models added to `components`. pydantic
    names the models apart where two share a name; one whose name the document already uses
    for something else is renamed."""
    models = list({id(t.args_model): t.args_model for t in tasks}.values())
    keys, top = models_json_schema([(m, "validation") for m in models], ref_template=REF_TEMPLATE)
    defs: dict[str, Any] = top.get("$defs", {})
    renames = {}
    for name, schema in defs.items():
        if name in components and components[name] != schema:
            new, n = f"{name}Args", 2
            while new in components or new in defs:
                new, n = f"{name}Args{n}", n + 1
            renames[name] = new
    _rename_refs(defs, renames)
    for name, schema in defs.items():
        components[renames.get(name, name)] = schema
    refs = {id(m): copy.deepcopy(keys[(m, "validation")]) for m in models}
    for ref in refs.values():
        _rename_refs(ref, renames)
    return {t.name: refs[id(t.args_model)] for t in tasks}


def _choices_describe(props: dict[str, Any], choices: SubmitChoices) -> None:
    """`priority`: a configured class, or "" / null for the tenant's default; `resources`:
    configured names (none may be named while none is configured)."""
    priority = props.get("priority")
    if priority is not None and choices.latency_classes:
        for branch in priority.get("anyOf", []):
            if branch.get("type") == "string":
                branch.pop("maxLength", None)
                branch["enum"] = ["", *choices.latency_classes]
    resources = props.get("resources")
    if resources is not None:
        if choices.resources:
            resources["items"] = {"type": "string", "enum": list(choices.resources)}
        else:
            resources["maxItems"] = 0


def _member(base: dict[str, Any], task: RegisteredTask, args: dict[str, Any], required_args: bool) -> dict[str, Any]:
    member = copy.deepcopy(base)
    member["title"] = f"Submit {task.name}"
    member["description"] = f"A job of the task `{task.name}`."
    props = member["properties"]
    props["task"] = {"const": task.name, "type": "string", "title": "Task"}
    props["args"] = {**args, "description": f"The arguments of {task.name}."}
    required = [r for r in member.get("required", []) if r != "args"]
    member["required"] = [*required, "args"] if required_args else required
    if not required_args:
        props["args"]["default"] = {}
    # A submit may lower the task's own timeout and retry policy, never raise them.
    _bound(props.get("timeout_seconds"), "maximum", task.timeout_seconds)
    _bound(props.get("max_attempts"), "maximum", task.retry.max_attempts)
    return member


def _bound(prop: dict[str, Any] | None, key: str, value: float | None) -> None:
    """Set `key` on the number branch of a nullable property's schema."""
    if prop is None or value is None:
        return
    for branch in prop.get("anyOf", [prop]):
        if branch.get("type") in ("number", "integer"):
            branch[key] = min(value, branch.get(key, value))


def _required_args(task: RegisteredTask) -> bool:
    return any(field.is_required() for field in task.args_model.model_fields.values())


def submit_bodies_describe(schema: dict[str, Any], *, base: str, choices: SubmitChoices) -> None:
    """Replace the generic submit body (component `base`) by the union of the registered
    tasks' members, wherever the document refers to it (POST /jobs, each job of a bulk)."""
    components: dict[str, Any] = schema.get("components", {}).get("schemas", {})
    if base not in components:
        return
    _choices_describe(components[base]["properties"], choices)
    tasks = [t for name in task_names() if (t := task_get(name)) is not None and not is_continuation(t)]
    if not tasks:
        return  # no task registered: the generic body is all there is to say
    generic = components.pop(base)
    args = _args_schemas(tasks, components)
    mapping = {}
    for task in tasks:
        name = member_name(task.name, set(components))
        components[name] = _member(generic, task, args[task.name], _required_args(task))
        mapping[task.name] = REF_TEMPLATE.format(model=name)
    components[SUBMISSION] = {
        "title": SUBMISSION,
        "description": "One job: `task` names a registered task and decides the schema of `args`.",
        "oneOf": [{"$ref": ref} for ref in mapping.values()],
        "discriminator": {"propertyName": "task", "mapping": mapping},
    }
    _rename_refs(schema.get("paths", {}), {base: SUBMISSION})
    _rename_refs(components, {base: SUBMISSION})


class TaskAwareNinjaAPI(NinjaAPI):
    """A NinjaAPI whose OpenAPI document describes each registered task's submit body
    (submit_bodies_describe over the component of `submit_model`)."""

    def __init__(self, *args: Any, submit_model: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.submit_model = submit_model

    def get_openapi_schema(
        self, *, path_prefix: str | None = None, path_params: dict[str, Any] | None = None
    ) -> OpenAPISchema:
        schema = super().get_openapi_schema(path_prefix=path_prefix, path_params=path_params)
        submit_bodies_describe(schema, base=self.submit_model, choices=submit_choices())
        return schema
