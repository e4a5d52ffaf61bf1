"""Unsaved model instances built as ``Model(**values)`` builds them, without its walk.

Why: a bulk submit builds one ``Job`` per job of the request, and ``Model.__init__`` (its
per-field loop over every keyword, the default of every field not given, the pre_init and
post_init signals) was a large part of the web process's CPU per bulk job. ``builder``
does the same once per model: it knows which fields take a given value and which their
default, and a build sets each field's attribute as ``__init__`` would (a relation through
its descriptor, which also sets its id and cache and the instance's database, as
``__init__`` does); the defaults are computed per instance (a callable default, such as
``dict``, gives each instance its own value). Where ``__init__`` would do more than that
(a receiver of pre_init or post_init for the model, a keyword that is not a field's name
or attname, a field left out of ``__init__``'s walk) the builder calls ``__init__`` itself.
tests/test_bulk_write.py checks a built ``Job`` against ``Job(**values)``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from django.db import models
from django.db.models.base import ModelState
from django.db.models.signals import post_init, pre_init

M = TypeVar("M", bound=models.Model)


Field = tuple[str, str, Callable[[], Any], bool]  # name, attname, default, whether a relation


@functools.cache
def _fields(model: type[models.Model]) -> tuple[Field, ...] | None:
    """The model's fields in ``__init__``'s order (so the instance's attributes come out in
    the same order too), or None when a field is one ``__init__`` treats apart."""
    fields: list[Field] = []
    for field in model._meta.fields:
        if field.generated or field.column is None:
            return None  # __init__ skips such fields unless given: not handled here
        fields.append(
            (field.name, field.attname, field.get_default, isinstance(field.remote_field, models.ForeignObjectRel))
        )
    return tuple(fields)


def builder(model: type[M]) -> Callable[..., M]:
    """A function ``build(**values)`` that returns what ``model(**values)`` returns. Make
    one per batch: the model's signal receivers are looked up when it is made."""
    fields = _fields(model)
    if fields is None or pre_init.has_listeners(model) or post_init.has_listeners(model):
        return model
    known = {name for name, _, _, _ in fields} | {attname for _, attname, _, _ in fields}
    both = [(name, attname) for name, attname, _, relation in fields if relation]
    new = model.__new__

    def build(**values: Any) -> M:
        if not known.issuperset(values):
            return model(**values)  # raises as __init__ does for a keyword it does not know
        for name, attname in both:  # (a loop, not any(): no generator per build)
            if name in values and attname in values:
                return model(**values)  # __init__ sets the relation, then the id as given
        obj = new(model)
        obj._state = ModelState()
        attrs = obj.__dict__
        for name, attname, default, relation in fields:
            if relation and name in values:
                setattr(obj, name, values[name])  # its descriptor: the id, the cache, the database
            else:
                attrs[attname] = values[attname] if attname in values else default()
        return obj

    return build
