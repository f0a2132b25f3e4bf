"""Tweet normalisation: each step, each switch, emoji kept, options round-trip."""
import pytest

from finetune.normalize import TweetNormalizer, normalize_texts, normalize_tweet


@pytest.mark.parametrize("raw,expected", [
    ("Look https://t.co/AbC123. Great!", "Look http. Great!"),          # trailing punctuation stays outside
    ("(see www.example.com/a?b=1)", "(see http)"),
    ("@realDonaldTrump you &amp; me &lt;3", "@user you & me <3"),         # entities decoded, mention replaced
    ("RT @a_b: hi @c!", "RT @user: hi @user!"),
    ("mail me at a@b.com or @ alone", "mail me at a@b.com or @ alone"),   # e-mails and lone @ are not mentions
    ("  so \t much\n\nspace  ", "so much space"),
    ("happy 😂😂 #blessed \u2764\ufe0f", "happy 😂😂 #blessed \u2764\ufe0f"),  # emoji untouched
])
def test_default_normalisation(raw, expected):
    assert normalize_tweet(raw) == expected


def test_each_step_switchable():
    text = "@bob  &amp; https://x.co/y  Sooooo"
    assert TweetNormalizer(mentions=False)(text) == "@bob & http Sooooo"
    assert TweetNormalizer(urls=False)(text) == "@user & https://x.co/y Sooooo"
    assert TweetNormalizer(html_entities=False)(text) == "@user &amp; http Sooooo"
    assert TweetNormalizer(whitespace=False)(text) == "@user  & http  Sooooo"
    assert TweetNormalizer(max_char_repeats=2, lowercase=True)(text) == "@user & http soo"
    assert TweetNormalizer(url_placeholder="<url>", user_placeholder="<user>")(text) == "<user> & <url> Sooooo"
    assert TweetNormalizer.identity()(text) == text
    assert normalize_texts([text, "a  b"], TweetNormalizer(urls=False)) == ["@user & https://x.co/y Sooooo", "a b"]


def test_options_round_trip():
    n = TweetNormalizer(urls=False, max_char_repeats=3)
    assert TweetNormalizer.from_dict(n.to_dict()) == n
    with pytest.raises(ValueError, match="unknown normalisation options"):
        TweetNormalizer.from_dict({"emoji": False})
    with pytest.raises(ValueError, match="max_char_repeats"):
        TweetNormalizer(max_char_repeats=0)
