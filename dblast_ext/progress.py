"""Progress bars for long runs: tqdm when it is installed and wanted, else a bar that does nothing."""


class _NoBar:
    def update(self, n=1):
        pass

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
