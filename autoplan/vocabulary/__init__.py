"""Words every stage shares: what unit names mean and their parsers, numbers and errors as a person
reads them, what a callable accepts, and tensors' leaves and bytes. Imports nothing of autoplan but
the vocabulary of `plan.py` and `errors.py`."""
