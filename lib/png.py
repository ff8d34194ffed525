"""PNG pictures by hand: a writer built on zlib, a scatter plot and an image grid.

Used by train_wpo_sgm_memory_efficient.py (samples against data), and meant for any later script
that wants to show a picture without a plotting library. The one idea: a PNG is a signature and a
few chunks (length, type, data, CRC-32); the pixels go into one IDAT chunk as zlib-compressed rows,
each row prefixed by a filter byte (0: stored as is). Everything else here only fills a uint8 array.
"""

import struct
import zlib

import numpy as np

SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _chunk(kind: bytes, data: bytes) -> bytes:
    # The CRC covers the chunk type and its data, not the length.
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def encode_png(pixels) -> bytes:
    """uint8 pixels, [H, W] (grayscale) or [H, W, 3] (RGB) -> the bytes of a PNG file."""
    a = np.asarray(pixels)
    if a.dtype != np.uint8:
        raise ValueError(f"PNG pixels must be uint8, got {a.dtype}")
    if a.ndim == 2:
        color_type, channels = 0, 1
    elif a.ndim == 3 and a.shape[2] == 3:
        color_type, channels = 2, 3
    else:
        raise ValueError(f"PNG pixels must be [H, W] or [H, W, 3], got shape {a.shape}")
    h, w = a.shape[:2]
    if h < 1 or w < 1:
        raise ValueError("a PNG needs at least one pixel")
    # IHDR: width, height, bit depth 8, colour type, compression 0, filter method 0, no interlace.
    ihdr = struct.pack(">IIBBBBB", w, h, 8, color_type, 0, 0, 0)
    rows = a.reshape(h, w * channels)
    raw = np.concatenate([np.zeros((h, 1), np.uint8), rows], axis=1).tobytes()  # filter byte 0 per row
    return SIGNATURE + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", zlib.compress(raw, 9)) + _chunk(b"IEND", b"")


def write_png(path: str, pixels):
    """Write pixels as a PNG file (to a temporary name first, then renamed: never a torn file)."""
    from lib.checkpoint import atomic_write

    data = encode_png(pixels)

    def write(tmp):
        with open(tmp, "wb") as f:
            f.write(data)

    atomic_write(path, write)


# --- drawing --------------------------------------------------------------------------------------
WHITE, BLACK, GREY = (255, 255, 255), (0, 0, 0), (160, 160, 160)
BLUE, RED = (40, 90, 200), (220, 40, 40)


def canvas(height: int, width: int, color=WHITE):
    img = np.empty((height, width, 3), np.uint8)
    img[:] = color
    return img


def draw_box(img, top: int, left: int, bottom: int, right: int, color=BLACK):
    """A one-pixel rectangle outline, corners included (inclusive coordinates)."""
    img[top, left:right + 1] = color
    img[bottom, left:right + 1] = color
    img[top:bottom + 1, left] = color
    img[top:bottom + 1, right] = color


def draw_points(img, rows, cols, color, radius: int = 1):
    """Square dots of side 2 * radius + 1 centred on (rows, cols); parts outside the image are cut."""
    h, w = img.shape[:2]
    rows, cols = np.asarray(rows, int), np.asarray(cols, int)
    for dr in range(-radius, radius + 1):
        for dc in range(-radius, radius + 1):
            r, c = rows + dr, cols + dc
            keep = (r >= 0) & (r < h) & (c >= 0) & (c < w)
            img[r[keep], c[keep]] = color


def scatter(point_sets, colors=(GREY, RED, BLUE), size: int = 400, margin: int = 12, radius: int = 1, bounds=None):
    """Draw 2-D point sets (each [N, 2]) on one square canvas inside an axes box, later sets on top.

    The axes share one scale, so circles stay circles; bounds = (xmin, xmax, ymin, ymax) fixes the
    view, else it is the union of the points with 5% padding. +y points up, as in a plot.
    """
    pts = [np.asarray(p, dtype=np.float64).reshape(-1, 2) for p in point_sets]
    if bounds is None:
        allp = np.concatenate([p[np.isfinite(p).all(1)] for p in pts] + [np.zeros((0, 2))])
        if len(allp) == 0:
            allp = np.array([[-1.0, -1.0], [1.0, 1.0]])
        lo, hi = allp.min(0), allp.max(0)
        centre, half = (lo + hi) / 2, max((hi - lo).max() / 2, 1e-9) * 1.05
        bounds = (centre[0] - half, centre[0] + half, centre[1] - half, centre[1] + half)
    xmin, xmax, ymin, ymax = bounds
    img = canvas(size, size)
    inner = size - 2 * margin - 1
    draw_box(img, margin, margin, size - margin - 1, size - margin - 1)
    for p, color in zip(pts, colors):
        p = p[np.isfinite(p).all(1)]
        cols = margin + (p[:, 0] - xmin) / (xmax - xmin) * inner
        rows = size - 1 - margin - (p[:, 1] - ymin) / (ymax - ymin) * inner
        inside = (cols >= margin) & (cols <= size - margin - 1) & (rows >= margin) & (rows <= size - margin - 1)
        draw_points(img, np.round(rows[inside]), np.round(cols[inside]), color, radius)
    return img


def image_grid(images, ncols: int = 8, pad: int = 2, scale: int = 1, background=WHITE):
    """Tile images ([N, H, W, 3] or [N, H, W], floats in [0, 1] or uint8) into one picture, row by row,
    each pixel repeated scale x scale times so small images stay visible."""
    a = np.asarray(images)
    if a.dtype != np.uint8:
        a = (np.clip(np.nan_to_num(a.astype(np.float64)), 0, 1) * 255 + 0.5).astype(np.uint8)
    if a.ndim == 3:
        a = np.repeat(a[..., None], 3, axis=3)
    n, h, w = a.shape[:3]
    a = a.repeat(scale, axis=1).repeat(scale, axis=2)
    h, w = h * scale, w * scale
    ncols = max(1, min(ncols, n))
    nrows = -(-n // ncols)
    img = canvas(nrows * (h + pad) + pad, ncols * (w + pad) + pad, background)
    for i in range(n):
        r, c = divmod(i, ncols)
        top, left = pad + r * (h + pad), pad + c * (w + pad)
        img[top:top + h, left:left + w] = a[i]
    return img


def side_by_side(left, right, gap: int = 8, background=WHITE):
    """Two pictures next to each other, top-aligned."""
    h = max(left.shape[0], right.shape[0])
    img = canvas(h, left.shape[1] + gap + right.shape[1], background)
    img[:left.shape[0], :left.shape[1]] = left
    img[:right.shape[0], left.shape[1] + gap:] = right
    return img
