"""What a run says while it runs (rank 0 only): the model's size, the plan line before the first step (device,
precision, optimizer, steps and the estimated wall time of the whole run, validation and the test included), a hint
when a CPU run is far longer than a CPU user expects or its budget far shorter than its recipe's schedule, and the
progress of training. On a terminal that is a tqdm bar over the run's steps (not an epoch's: a resumed run's bar
starts where the run stands) with the latest loss and the whole run's time left; into a pipe or a log file, the
same line printed every tenth of the run, so a log holds lines rather than carriage returns."""

from __future__ import annotations

import sys

from tqdm import tqdm

HOUR_S = 3600.0
CPU_BUDGET_HINT = "--config configs/cpu_budget.yaml --max-time 00:00:10:00"
BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} steps [{elapsed}, {rate_noinv_fmt}{postfix}]"


def format_duration(seconds: float) -> str:
    """'41 h 10 min', '9 min 30 s', '45 s'."""
    seconds = max(int(round(seconds)), 0)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours} h {minutes} min"
    return f"{minutes} min {secs} s" if minutes else f"{secs} s"


def long_schedule_settings(recipe) -> list[str]:
    """The recipe's settings that regularise for a schedule of many epochs (they slow learning in a few)."""
    augment, model_args = recipe.augment, recipe.model_args or {}
    return [name for name, on in (("randaugment", augment.randaugment), ("mixup_alpha", augment.mixup_alpha),
                                  ("cutmix_alpha", augment.cutmix_alpha),
                                  ("drop_path_rate", model_args.get("drop_path_rate"))) if on]


def plan_lines(recipe, *, accelerator: str, machine: str, precision: str, steps: int, done: int,
               steps_per_epoch: int, budget_s: float | None, train_s: float, test_s: float, test_images: int,
               eval_passes: int, step_seconds: str, timed_before: bool) -> list[str]:
    """The plan line and, where it applies, one hint. ``steps``: the run's optimizer steps (those a budget buys);
    ``train_s``: the estimated seconds of training and validation left; ``test_s``: of the test after it."""
    if budget_s is None:
        schedule = f"{recipe.epochs} epochs x {steps_per_epoch} steps = {steps:,} steps"
    else:
        schedule = (f"{steps:,} step{'s' if steps != 1 else ''} (about {steps / steps_per_epoch:.2g} of the recipe's "
                    f"{recipe.epochs} epochs of {steps_per_epoch} steps) in --max-time {recipe.max_time}")
    if done:
        schedule += f", {done:,} done"
    test = (f"{format_duration(test_s)} the test of {test_images:,} images x {eval_passes} "
            f"pass{'es' if eval_passes > 1 else ''}") if test_images else "no test"
    eta = train_s + test_s
    lines = [f"{accelerator} ({machine}), precision {precision}, optimizer {recipe.optimizer}, batch "
             f"{recipe.batch_size}: {schedule}; about {format_duration(eta)} in all ({format_duration(train_s)} "
             f"training and validation, {test}; {step_seconds}, "
             f"{'timed before training' if timed_before else 'measured'})"]
    regularisers = long_schedule_settings(recipe)
    if budget_s is not None and steps < 3 * steps_per_epoch and recipe.epochs >= 30 and regularisers:
        lines.append(f"the budget covers {steps / steps_per_epoch:.2g} of {recipe.epochs} epochs, and the recipe "
                     f"regularises for all of them ({', '.join(regularisers)}): for a budget of minutes add "
                     "--config configs/cpu_budget.yaml")
    elif accelerator == "cpu" and eta > HOUR_S and budget_s is None:
        data = f" --data-dir {recipe.data_dir}" if recipe.data_dir else ""
        lines.append(f"on a CPU that is long: the CPU-sized recipe trains {recipe.model} in 10 minutes: "
                     f"python train.py --model {recipe.model}{data} {CPU_BUDGET_HINT}")
    return lines


def step_seconds_text(times: tuple[float, float], low_res_size: int | None, img_size: int) -> str:
    """The plan line's step time: "0.5 s a step", or per size with progressive resizing."""
    low, full = times
    if not low_res_size:
        return f"{full:.3g} s a step"
    return f"{low:.3g} s a step at {low_res_size}x{low_res_size}, {full:.3g} s at {img_size}x{img_size}"


class Progress:
    """The training progress of rank 0 (``enabled``), as the module says: ``say`` prints a line (above the bar on
    a terminal), ``update`` moves the count to the run's step with the latest values (read from the device only
    when the line is drawn: ``due`` says when), ``validation`` / ``test`` give a bar over their batches on a
    terminal."""

    def __init__(self, enabled: bool, terminal: bool | None = None, refresh_every: int = 1):
        self.enabled = enabled
        self.terminal = sys.stdout.isatty() if terminal is None else terminal
        self.refresh_every = refresh_every
        self.bar: tqdm | None = None
        self._printed_at = -1

    def say(self, line: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None and self.terminal:
            self.bar.write(line, file=sys.stdout)
        else:
            print(line, flush=True)

    def start(self, epoch: int, step: int, total: int) -> None:
        """The bar over the run's ``total`` steps, drawn with its count (``step``, after a resume) and total."""
        if not self.enabled:
            return
        out = sys.stdout if self.terminal else _Unwritten()
        self.bar = tqdm(desc=f"Epoch {epoch}", total=total, initial=step, bar_format=BAR_FORMAT, file=out,
                        dynamic_ncols=self.terminal, smoothing=0, leave=True, mininterval=0)
        if not self.terminal:
            self._print_line()

    def due(self, step: int) -> bool:
        """Whether the line is drawn after ``step`` (its values are read from the device then)."""
        if not self.enabled or self.bar is None:
            return False
        if self.terminal:
            return step % self.refresh_every == 0
        tenth = max(self.bar.total // 10, 1)
        return step % tenth == 0 or step >= self.bar.total

    def update(self, epoch: int, step: int, total: int, values: dict[str, str] | None = None) -> None:
        if self.bar is None:
            return
        self.bar.total = total
        self.bar.set_description(f"Epoch {epoch}", refresh=False)
        if values is not None:
            self.bar.set_postfix(values, refresh=False)
        self.bar.n = step
        if self.terminal:
            self.bar.refresh()
        elif values is not None:
            self._print_line()

    def _print_line(self) -> None:
        if self.bar.n != self._printed_at:
            self._printed_at = self.bar.n
            print(str(self.bar), flush=True)

    def close(self) -> None:
        if self.bar is not None:
            if not self.terminal and self.bar.n != self._printed_at:
                self._print_line()
            self.bar.close()
            self.bar = None

    def batches(self, description: str, total: int, position: int):
        """A bar over ``total`` evaluation batches on a terminal (below the training bar: ``position`` 1), else
        nothing to draw."""
        if not (self.enabled and self.terminal):
            return None
        return tqdm(desc=description, total=total, position=position, leave=position == 0, file=sys.stdout,
                    dynamic_ncols=True)


class _Unwritten:
    """Where a bar that is printed line by line writes itself: nowhere (``Progress`` prints its lines)."""

    def write(self, text: str) -> None:
        pass

    def flush(self) -> None:
        pass
