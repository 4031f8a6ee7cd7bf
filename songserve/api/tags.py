"""The tag catalogue for tag-mode frontends (``GET /tags``): our own, four categories."""

TAGS: dict[str, dict] = {
    "genre_style": {
        "label": "Genre & style",
        "tags": ["pop", "rock", "indie", "folk", "jazz", "blues", "soul", "r&b", "hip hop", "rap", "electronic",
                 "house", "techno", "ambient", "lo-fi", "classical", "orchestral", "country", "metal", "punk",
                 "reggae", "latin", "k-pop", "c-pop", "ballad", "disco", "funk", "gospel", "cinematic"],
    },
    "vocal_instrument": {
        "label": "Vocals & instruments",
        "tags": ["female vocal", "male vocal", "duet", "choir", "rap vocal", "whisper", "piano", "acoustic guitar",
                 "electric guitar", "bass", "drums", "strings", "violin", "cello", "synth", "saxophone",
                 "trumpet", "flute", "808", "harp"],
    },
    "emotion_mood": {
        "label": "Emotion & mood",
        "tags": ["happy", "sad", "melancholic", "romantic", "energetic", "calm", "dreamy", "dark", "uplifting",
                 "nostalgic", "angry", "hopeful", "playful", "epic", "mellow", "tense"],
    },
    "production_other": {
        "label": "Production & other",
        "tags": ["slow tempo", "mid tempo", "fast tempo", "live recording", "studio", "reverb", "lo-fi texture",
                 "polished", "minimal", "big chorus", "instrumental break", "fade out", "acoustic", "analog"],
    },
}
