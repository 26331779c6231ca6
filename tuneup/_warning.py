"""The category of every warning tuneup emits, in a module of its own so that any room can
raise it without importing the options (which import the rule and action catalogs)."""


class TuneupWarning(UserWarning):
    """Every warning the agent emits has this category, so users can filter them."""
