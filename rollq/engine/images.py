"""A group's images into vLLM's multimodal input, as vLLM's OpenAI server would build it.

The worker's `ImageLoader` (`rollq/images.py`) reads the bytes from Redis, checks their digest
and decodes them with Pillow after checking the header's dimensions. Here the pixels are
normalized as vLLM's own image loader does for a data URL (EXIF orientation, RGB on a white
background), then a token or text prompt goes through vLLM's renderer with
`multi_modal_data={"image": [...]}` (the model's processor expands each image placeholder), and
a chat gets `image_pil` parts for vLLM's chat renderer. Every refusal is the group's, never the
engine's: GroupError with the reason.
"""

from __future__ import annotations

import asyncio
from typing import Any

from rollq.engine.base import GroupError
from rollq.images import ImageLoader, chat_with_images
from rollq.protocol import Chat, InvalidInput, WorkItem


class EngineImages:
    def __init__(self, llm: Any, loader: ImageLoader | None = None):
        self._llm = llm
        self.loader = loader
        """None: the engine runs outside a worker (tests); groups with images then fail."""

    async def _decoded(self, item: WorkItem) -> list[Any]:
        from vllm.multimodal.image import convert_image_mode, normalize_image

        if not item.images:
            return []
        if self.loader is None:
            raise GroupError("the group has images, but this engine reads no image store")
        try:
            images = await self.loader.load(item.images)
        except InvalidInput as e:
            raise GroupError(f"image refused: {e}") from None
        return [convert_image_mode(normalize_image(im), "RGB") for im in images]

    async def chat(self, item: WorkItem) -> Chat:
        """The conversation with its images decoded; any media part that is not one of the group's
        images (a remote URL, embeddings, audio) is refused."""
        assert item.chat is not None
        images = await self._decoded(item)
        try:
            return chat_with_images(item.chat, item.images, images)
        except InvalidInput as e:
            raise GroupError(f"invalid chat: {e}") from None

    async def prompt(self, prompt: dict[str, Any], item: WorkItem) -> dict[str, Any]:
        """A token or text prompt with the group's images -> vLLM's engine input (its processor
        has run: placeholders expanded, pixels turned into the model's tensors)."""
        images = await self._decoded(item)
        # Convert prompt + images --> EngineInput, vLLM's renderer (the model's processor).
        try:
            (engine_input,) = await self._llm.renderer.render_cmpl_async(
                [{**prompt, "multi_modal_data": {"image": images}}])
        except asyncio.CancelledError:
            raise
        except Exception as e:  # processors raise anything: a count mismatch is this group's fault
            raise GroupError(f"vLLM refused the images: {type(e).__name__}: {e}") from None
        return engine_input


def image_tokens(engine_input: Any) -> int:
    """Prompt tokens the images took: the lengths of vLLM's placeholder ranges."""
    placeholders = engine_input.get("mm_placeholders") if isinstance(engine_input, dict) else None
    return sum(r.length for ranges in (placeholders or {}).values() for r in ranges)
