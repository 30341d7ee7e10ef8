"""plot.svg as a browser draws it (tests only): a headless Chromium screenshot, read back with Pillow,
and per panel the pixels of a colour inside the panel's frame.

The panels' frames come from the SVG itself (src/monitor/plot_svg.cpp draws each frame as a
`<rect ... fill="none" stroke="#888"/>` after its title), so a test knows where each panel is drawn
without repeating the layout. Needs Debian's `chromium` and `python3-pil` (scripts/setup.sh).
"""
import os
import re
import shutil
import subprocess
import tempfile

FRAME_RE = re.compile(r'<rect x="([0-9.]+)" y="([0-9.]+)" width="([0-9.]+)" height="([0-9.]+)" '
                      r'fill="none" stroke="#888"/>')
TITLE_RE = re.compile(r'<text x="[0-9.]+" y="[0-9.]+" font-weight="bold">([^<]*)</text>')
SIZE_RE = re.compile(r'<svg [^>]*width="([0-9.]+)" height="([0-9.]+)"')


def chromium():
    """The chromium binary, or None."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


def missing():
    """Why a screenshot cannot be taken here ("" when it can)."""
    if not chromium():
        return "chromium is not installed (Debian's chromium package; scripts/setup.sh installs it)"
    try:
        import PIL.Image  # noqa: F401
    except ImportError:
        return "Pillow is not installed (Debian's python3-pil; scripts/setup.sh installs it)"
    return ""


def panels(svg_text):
    """[(title, (x, y, w, h))] of every panel, top to bottom."""
    titles = TITLE_RE.findall(svg_text)
    frames = [tuple(float(v) for v in m) for m in FRAME_RE.findall(svg_text)]
    if len(titles) != len(frames):
        raise AssertionError(f"{len(titles)} panel titles but {len(frames)} frames in the SVG")
    return list(zip(titles, frames))


def screenshot(svg_path, timeout=60):
    """Renders svg_path in headless Chromium at its own size; returns a Pillow RGB image."""
    import PIL.Image
    with open(svg_path) as f:
        m = SIZE_RE.search(f.read())
    w, h = int(float(m.group(1))), int(float(m.group(2)))
    with tempfile.TemporaryDirectory(prefix="dtrain_shot_") as tmp:
        png = os.path.join(tmp, "shot.png")
        # --no-sandbox: the tests may run as root, where Chromium's sandbox refuses to start.
        argv = [chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                f"--user-data-dir={tmp}/profile", f"--window-size={w},{h}", f"--screenshot={png}",
                "file://" + os.path.abspath(svg_path)]
        res = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout,
                             stdin=subprocess.DEVNULL)
        if res.returncode != 0 or not os.path.exists(png):
            raise AssertionError(f"chromium failed (exit {res.returncode}):\n"
                                 + res.stdout.decode(errors="replace")[-2000:])
        img = PIL.Image.open(png).convert("RGB")
        img.load()
        return img


def hex_rgb(color):
    return tuple(int(color[i:i + 2], 16) for i in (1, 3, 5))


def count_pixels(img, rect, color, tolerance=24):
    """Pixels strictly inside rect (x, y, w, h) within `tolerance` of color on every channel."""
    x, y, w, h = rect
    want = hex_rgb(color)
    px = img.load()
    n = 0
    for j in range(int(y) + 2, min(img.height, int(y + h) - 1)):
        for i in range(int(x) + 2, min(img.width, int(x + w) - 1)):
            p = px[i, j]
            if all(abs(p[c] - want[c]) <= tolerance for c in range(3)):
                n += 1
    return n
