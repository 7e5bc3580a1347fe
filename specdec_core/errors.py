"""User-facing errors: one clear line that names the fix, never a traceback from the CLI or a job."""


class SpecbatchError(Exception):
    """An error caused by the user's input or environment, with a message that says how to fix it."""


class UnknownModelError(SpecbatchError):
    pass


class ModelPackageMissingError(SpecbatchError):
    pass


class ChecksumMismatchError(SpecbatchError):
    pass


class UnknownMethodError(SpecbatchError):
    pass


class BadRequestError(SpecbatchError):
    """A request that cannot be decoded (empty prompt, prompt over the context limit, bad text)."""
