"""The one exception type for problems the user can fix (bad params, data or checkpoint)."""


class UserError(Exception):
    """A problem in the user's input: reported as one line, exit code 2, no traceback."""


def past_learned_positions(position: int, limit: int) -> UserError:
    """The error of a sequence reaching `position` in a checkpoint with `limit` learned position embeddings."""
    return UserError(f"position {position} is past the {limit} learned position embeddings of this checkpoint; "
                     f"lower max_seq_len to at most {limit}")
