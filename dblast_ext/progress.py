"""Progress bars for long runs: tqdm when it is installed and wanted, else a bar that does nothing."""


class _NoBar:
    """Shows nothing; counts like tqdm (`n`) for callers that read how far a bar got."""

    def __init__(self):
        self.n = 0

    def update(self, n=1):
        self.n += n

    def set_postfix(self, **kwargs):
        pass

    def close(self):
        pass


def progress_bar(total: int, *, desc: str, unit: str, initial: int = 0, enabled: bool = True):
    if enabled:
        try:
            from tqdm.auto import tqdm
        except ImportError:
            return _NoBar()
        return tqdm(total=total, initial=initial, desc=desc, unit=unit)
    return _NoBar()
