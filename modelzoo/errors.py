"""The one exception type for problems the user can fix (bad params, data or checkpoint)."""


class UserError(Exception):
    """A problem in the user's input: reported as one line, exit code 2, no traceback."""
