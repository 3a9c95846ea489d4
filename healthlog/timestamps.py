"""Parse and format the timestamps Health Auto Export sends, as integer UTC microseconds.

See specs/timestamps.md for the accepted shapes and the rules.
"""

import functools
import re
import unicodedata

__all__ = [
    "TIMESTAMP_EXAMPLE",
    "US_PER_HOUR",
    "TimestampError",
    "format_instant",
    "hour_of",
    "latin_digits",
    "parse_instant",
]

_US_PER_SECOND = 1_000_000
_US_PER_MINUTE = 60 * _US_PER_SECOND
US_PER_HOUR = 60 * _US_PER_MINUTE
_US_PER_DAY = 24 * US_PER_HOUR
_MAX_LENGTH = 64
_MAX_OFFSET_MINUTES = 18 * 60
_DAYS_IN_MONTH = (0, 31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)
TIMESTAMP_EXAMPLE = "2024-02-06T15:00:00Z"
"""An instant in the shape healthlog writes, for a message that says what is accepted."""

# The app's own shape, `2024-02-06 07:00:00 -0800`: the fast path.
_COMMON = re.compile(
    r"([0-9]{4})-([0-9]{2})-([0-9]{2}) ([0-9]{2}):([0-9]{2}):([0-9]{2}) ([+-])([0-9]{2})([0-9]{2})"
)

# The 12-hour markers a phone writes, as iOS does in the phone's language: CLDR's abbreviated
# AM and PM of the format context, and for Traditional Chinese and Burmese, whose 12-hour time is
# `Bh:mm:ss`, their flexible day periods (specs/timestamps.md rule 5 names the languages and the
# sources). Each is the marker as matched with its letters case-folded and any space inside it
# dropped, and says which hours its clock counts, 1..12, or 0..11 for Japanese, whose 12-hour
# clock counts from 0 (`午前0:05`), and which hours of the day it names: from the first up to
# the second (AM 0..12, PM 12..24; a day period its CLDR 42 rule's, 晚上 19..24).
_MARKERS = {
    "am": (1, 0, 12),
    "pm": (1, 12, 24),
    "a.m.": (1, 0, 12),
    "p.m.": (1, 12, 24),
    "π.μ.": (1, 0, 12),
    "μ.μ.": (1, 12, 24),
    "ص": (1, 0, 12),
    "م": (1, 12, 24),
    "오전": (1, 0, 12),
    "오후": (1, 12, 24),
    "午前": (0, 0, 12),
    "午後": (0, 12, 24),
    "上午": (1, 0, 12),
    "下午": (1, 12, 24),
    "öö": (1, 0, 12),
    "ös": (1, 12, 24),
    "sa": (1, 0, 12),
    "ch": (1, 12, 24),
    "pg": (1, 0, 12),
    "ptg": (1, 12, 24),
    "முற்பகல்": (1, 0, 12),
    "பிற்பகல்": (1, 12, 24),
    "ق.ظ.": (1, 0, 12),
    "ب.ظ.": (1, 12, 24),
    "غ.م.": (1, 0, 12),
    "غ.و.": (1, 12, 24),
    "पूर्वाह्न": (1, 0, 12),
    "अपराह्न": (1, 12, 24),
    "পূৰ্বাহ্ন": (1, 0, 12),
    "অপৰাহ্ন": (1, 12, 24),
    "ب.ن": (1, 0, 12),
    "د.ن": (1, 12, 24),
    "صبح،منجهند": (1, 0, 12),
    "شام،منجهند": (1, 12, 24),
    "སྔ་ཆ་": (1, 0, 12),
    "ཕྱི་ཆ་": (1, 12, 24),
    "vm.": (1, 0, 12),
    "nm.": (1, 12, 24),
    "a.g": (1, 0, 12),
    "a.k": (1, 12, 24),
    "an": (1, 0, 12),
    "ew": (1, 12, 24),
    "ጥዋት": (1, 0, 12),
    "ከሰዓት": (1, 12, 24),
    "icheheavo": (1, 0, 12),
    "ichamthi": (1, 12, 24),
    "ам": (1, 0, 12),
    "пм": (1, 12, 24),
    "ibikɛ̂glà": (1, 0, 12),
    "iɓugajɔp": (1, 12, 24),
    "апоўначы": (1, 0, 12),
    "апоўдні": (1, 12, 24),
    "uluchelo": (1, 0, 12),
    "akasuba": (1, 12, 24),
    "pamilau": (1, 0, 12),
    "pamunyi": (1, 12, 24),
    "སྔ་དྲོ་": (1, 0, 12),
    "ཕྱི་དྲོ་": (1, 12, 24),
    "g.m.": (1, 12, 24),
    "फुं": (1, 0, 12),
    "बेलासे": (1, 12, 24),
    "преподне": (1, 0, 12),
    "поподне": (1, 12, 24),
    "ᏌᎾᎴ": (1, 0, 12),
    "ᏒᎯᏱᎢ": (1, 12, 24),
    "dop.": (1, 0, 12),
    "odp.": (1, 12, 24),
    "lumalwak": (1, 0, 12),
    "lumalwap": (1, 12, 24),
    "subbaahi": (1, 0, 12),
    "zaarikayb": (1, 12, 24),
    "सवेर": (1, 0, 12),
    "स\u2019ञ": (1, 12, 24),
    "wótp.": (1, 12, 24),
    "idiɓa": (1, 0, 12),
    "ebyámu": (1, 12, 24),
    "ki": (1, 0, 12),
    "ut": (1, 12, 24),
    "atm": (1, 0, 12),
    "ptm": (1, 12, 24),
    "kíkíríg": (1, 0, 12),
    "ngəgógəle": (1, 12, 24),
    "subaka": (1, 0, 12),
    "kikiiɗe": (1, 12, 24),
    "𞤢𞤰": (1, 0, 12),
    "𞤩𞤰": (1, 12, 24),
    "i/m": (1, 0, 12),
    "e/m": (1, 12, 24),
    "a.": (1, 0, 12),
    "p.": (1, 12, 24),
    "r.n.": (1, 0, 12),
    "i.n.": (1, 12, 24),
    "m": (1, 0, 12),
    "f": (1, 12, 24),
    "vorm.": (1, 0, 12),
    "nam.": (1, 12, 24),
    "ma": (1, 0, 12),
    "mo": (1, 12, 24),
    "sf": (1, 0, 12),
    "ym": (1, 12, 24),
    "לפנה״צ": (1, 0, 12),
    "אחה״צ": (1, 12, 24),
    "pop.": (1, 12, 24),
    "de.": (1, 0, 12),
    "du.": (1, 12, 24),
    "ꎸꄑ": (1, 0, 12),
    "ꁯꋒ": (1, 12, 24),
    "f.h.": (1, 0, 12),
    "e.h.": (1, 12, 24),
    "mba\ua78cmba\ua78c": (1, 0, 12),
    "ŋkambɔ́tnji": (1, 12, 24),
    "utuko": (1, 0, 12),
    "kyiukonyi": (1, 12, 24),
    "isuk": (1, 0, 12),
    "wengi": (1, 12, 24),
    "ntufat": (1, 0, 12),
    "ntmeddit": (1, 12, 24),
    "ĩyakwakya": (1, 0, 12),
    "ĩyawĩoo": (1, 12, 24),
    "muhi": (1, 0, 12),
    "chilo": (1, 12, 24),
    "adduha": (1, 0, 12),
    "aluula": (1, 12, 24),
    "kiroko": (1, 0, 12),
    "hwaĩ-inĩ": (1, 12, 24),
    "u.t.": (1, 0, 12),
    "u.k.": (1, 12, 24),
    "krn": (1, 0, 12),
    "koosk": (1, 12, 24),
    "ಪೂರ್ವಾಹ್ನ": (1, 0, 12),
    "ಅಪರಾಹ್ನ": (1, 12, 24),
    "makeo": (1, 0, 12),
    "nyiaghuo": (1, 12, 24),
    "sárúwá": (1, 0, 12),
    "cɛɛ́nko": (1, 12, 24),
    "v.m.": (1, 0, 12),
    "n.m.": (1, 12, 24),
    "bn": (1, 0, 12),
    "pn": (1, 12, 24),
    "тң": (1, 0, 12),
    "тк": (1, 12, 24),
    "too": (1, 0, 12),
    "muu": (1, 12, 24),
    "moies": (1, 0, 12),
    "nomëttes": (1, 12, 24),
    "ntɔ́ngɔ́": (1, 0, 12),
    "mpókwa": (1, 12, 24),
    "ກ່ອນທ່ຽງ": (1, 0, 12),
    "ຫຼັງທ່ຽງ": (1, 12, 24),
    "priešpiet": (1, 0, 12),
    "popiet": (1, 12, 24),
    "dinda": (1, 0, 12),
    "dilolo": (1, 12, 24),
    "od": (1, 0, 12),
    "ot": (1, 12, 24),
    "priekšp.": (1, 0, 12),
    "pēcp.": (1, 12, 24),
    "भोर": (1, 0, 12),
    "सांझ": (1, 12, 24),
    "ɛnkakɛnyá": (1, 0, 12),
    "ɛndámâ": (1, 12, 24),
    "rũ": (1, 0, 12),
    "ũg": (1, 12, 24),
    "wichishu": (1, 0, 12),
    "mchochil\u2019l": (1, 12, 24),
    "претпл.": (1, 0, 12),
    "попл.": (1, 12, 24),
    "\u04af.ө.": (1, 0, 12),
    "\u04af.\u0445.": (1, 12, 24),
    "নুমাং": (1, 0, 12),
    "comme": (1, 0, 12),
    "lilli": (1, 12, 24),
    "ǁgoagas": (1, 0, 12),
    "\u01c3uias": (1, 12, 24),
    "vm": (1, 0, 12),
    "nm": (1, 12, 24),
    "maná": (1, 0, 12),
    "kugú": (1, 12, 24),
    "f.m.": (1, 0, 12),
    "e.m.": (1, 12, 24),
    "mba\u02bcámba\u02bc": (1, 0, 12),
    "ncwònzém": (1, 12, 24),
    "rw": (1, 0, 12),
    "tŋ": (1, 12, 24),
    "wd": (1, 0, 12),
    "wb": (1, 12, 24),
    "ਪੂ.ਦੁ.": (1, 0, 12),
    "ਬਾ.ਦੁ.": (1, 12, 24),
    "fm": (1, 0, 12),
    "fi": (1, 12, 24),
    "z.mu.": (1, 0, 12),
    "z.mw.": (1, 12, 24),
    "kang\u2019ama": (1, 0, 12),
    "kingoto": (1, 12, 24),
    "эи": (1, 0, 12),
    "эк": (1, 12, 24),
    "tesiran": (1, 0, 12),
    "teipa": (1, 12, 24),
    "lwamilawu": (1, 0, 12),
    "pashamihe": (1, 12, 24),
    "i.b.": (1, 0, 12),
    "e.b.": (1, 12, 24),
    "ib": (1, 0, 12),
    "eb": (1, 12, 24),
    "nd": (1, 0, 12),
    "lk": (1, 12, 24),
    "ⵜⵉⴼⴰⵡⵜ": (1, 0, 12),
    "ⵜⴰⴷⴳⴳⵯⴰⵜ": (1, 12, 24),
    "tifawt": (1, 0, 12),
    "tadggʷat": (1, 12, 24),
    "පෙ.ව.": (1, 0, 12),
    "ප.ව.": (1, 12, 24),
    "gh": (1, 0, 12),
    "gd": (1, 12, 24),
    "p.d.": (1, 0, 12),
    "m.d.": (1, 12, 24),
    "пријеподне": (1, 0, 12),
    "prijepodne": (1, 0, 12),
    "popodne": (1, 12, 24),
    "em": (1, 12, 24),
    "taparachu": (1, 0, 12),
    "ebongi": (1, 12, 24),
    "ቅ.ቀ.": (1, 0, 12),
    "ድ.ቀ.": (1, 12, 24),
    "go.öň": (1, 0, 12),
    "go.soň": (1, 12, 24),
    "zdatazal": (1, 0, 12),
    "ḍeffiraza": (1, 12, 24),
    "چ.ب": (1, 0, 12),
    "چ.ك": (1, 12, 24),
    "дп": (1, 0, 12),
    "пп": (1, 12, 24),
    "to": (1, 0, 12),
    "tk": (1, 12, 24),
    "то": (1, 0, 12),
    "sub": (1, 0, 12),
    "ngo": (1, 12, 24),
    "munkyo": (1, 0, 12),
    "eigulo": (1, 12, 24),
    "kiɛmɛ́ɛm": (1, 0, 12),
    "kisɛ́ndɛ": (1, 12, 24),
    "פֿאַרמיטאָג": (1, 0, 12),
    "נאָכמיטאָג": (1, 12, 24),
    "àárọ̀": (1, 0, 12),
    "ọ̀sán": (1, 12, 24),
    "àárɔ̀": (1, 0, 12),
    "ɔ̀sán": (1, 12, 24),
    "凌晨": (1, 0, 5),
    "清晨": (1, 5, 8),
    "中午": (1, 12, 13),
    "晚上": (1, 19, 24),
    "ŋdiga": (1, 0, 12),
    "\u0263etrɔga": (1, 12, 24),
    "နံနက်": (1, 0, 12),
    "မွန်းတည့်": (1, 12, 13),
    "နေ့လယ်": (1, 12, 16),
    "ညနေ": (1, 16, 19),
    "ည": (1, 19, 24),
}
_SPACES = "[ \u00a0\u202f]"
_NO_SPACES = dict.fromkeys(map(ord, " \u00a0\u202f"))
_MARKER = (
    rf"(?i:[ap]m|[ap]\.{_SPACES}?m\.|π\.μ\.|μ\.μ\.|ص|م|오전|오후|午前|午後|上午|下午"
    r"|ÖÖ|ÖS|SA|CH|PTG|PG|முற்பகல்|பிற்பகல்"
    r"|ق\.ظ\.|ب\.ظ\.|غ\.م\.|غ\.و\.|पूर्वाह्न|अपराह्न|পূৰ্বাহ্ন|অপৰাহ্ন|ب\.ن|د\.ن"
    rf"|صبح،{_SPACES}?منجهند|شام،{_SPACES}?منجهند|སྔ་ཆ་|ཕྱི་ཆ་"
    r"|vm\.|nm\.|a\.g|a\.k|AN|EW|ጥዋት|ከሰዓት|icheheavo|ichamthi|\u0410\u041c|П\u041c"
    rf"|I{_SPACES}?bikɛ̂glà|I{_SPACES}?ɓugajɔp|апоўначы|апоўдні|uluchelo|akasuba|pamilau"
    rf"|pamunyi|སྔ་དྲོ་|ཕྱི་དྲོ་|A\.M\.|G\.M\.|फुं|बेलासे|пре{_SPACES}?подне|поподне|ᏌᎾᎴ|ᏒᎯᏱᎢ"
    rf"|dop\.|odp\.|Luma{_SPACES}?lwa{_SPACES}?K|luma{_SPACES}?lwa{_SPACES}?p|Subbaahi"
    rf"|Zaarikay{_SPACES}?b|सवेर|स\u2019ञ|wótp\.|idiɓa|ebyámu|KI|UT|atm|ptm|kíkíríg|ngəgógəle"
    r"|subaka|kikiiɗe|𞤀𞤎|𞤇𞤎|i/m|e/m|a\.|p\.|r\.n\.|i\.n\.|m|f|vorm\.|nam\.|Ma|Mo|SF|YM"
    r"|לפנה״צ|אחה״צ|pop\.|de\.|du\.|ꎸꄑ|ꁯꋒ|f\.h\.|e\.h\.|mba\ua78cmba\ua78c"
    rf"|ŋka{_SPACES}?mbɔ́t{_SPACES}?nji|utuko|kyiukonyi|Isuk|Wengi|n{_SPACES}?tufat"
    rf"|n{_SPACES}?tmeddit|Ĩyakwakya|Ĩyawĩoo|Muhi|Chilo|Adduha|Aluula|Kiroko|Hwaĩ\-inĩ|u\.t\."
    r"|u\.k\.|krn|koosk|ಪೂರ್ವಾಹ್ನ|ಅಪರಾಹ್ನ|makeo|nyiaghuo|sárúwá|cɛɛ́nko|v\.M\.|n\.M\.|BN|PN"
    r"|тң|тк|TOO|MUU|moies|nomëttes|ntɔ́ngɔ́|mpókwa|ກ່ອນທ່ຽງ|ຫຼັງທ່ຽງ|priešpiet|popiet|Dinda"
    r"|Dilolo|OD|OT|priekšp\.|pēcp\.|भोर|सांझ|Ɛnkakɛnyá|Ɛndámâ|RŨ|ŨG|wichishu"
    r"|mchochil\u2019l|претпл\.|попл\.|\u04af\.ө\.|\u04af\.\u0445\.|নুমাং|PM|comme|lilli"
    r"|ǁgoagas|\u01c3uias|vm|nm|maná|kugú|f\.m\.|e\.m\.|mba\u02bcámba\u02bc|ncwònzém|RW|TŊ"
    r"|WD|WB|ਪੂ\.ਦੁ\.|ਬਾ\.ਦੁ\.|FM|FI|Z\.MU\.|Z\.MW\.|kang\u2019ama|kingoto|ЭИ|ЭК|Tesiran"
    r"|Teipa|Lwamilawu|Pashamihe|i\.b\.|e\.b\.|ib|eb|ND|LK|ⵜⵉⴼⴰⵡⵜ|ⵜⴰⴷⴳⴳⵯⴰⵜ|tifawt|tadggʷat"
    rf"|පෙ\.ව\.|ප\.ව\.|GH|GD|p\.d\.|m\.d\.|прије{_SPACES}?подне|по{_SPACES}?подне"
    rf"|prije{_SPACES}?podne|po{_SPACES}?podne|em|Taparachu|Ebongi|ቅ\.ቀ\.|ድ\.ቀ\.|go\.öň"
    rf"|go\.soň|Zdat{_SPACES}?azal|Ḍeffir{_SPACES}?aza|چ\.ب|چ\.ك|дп|пп|TO|TK|\u0422\u041e|Sub"
    r"|Ngo|Munkyo|Eigulo|kiɛmɛ́ɛm|kisɛ́ndɛ|פֿאַרמיטאָג|נאָכמיטאָג|Àárọ̀|Ọ̀sán|Àárɔ̀|Ɔ̀sán"
    rf"|ŋdi{_SPACES}?ga|\u0263etrɔ{_SPACES}?ga|凌晨|清晨|中午|晚上|နံနက်|မွန်းတည့်|နေ့လယ်|ညနေ|ည)"
)
# Ewe's markers stand before the time with `ga` between (CLDR's `a 'ga' h:mm:ss`), read as one
# marker; Togo's Ewe also writes `le` after the time (`ŋdi ga 7:57:00 le +1000`, ICU 72's best
# `hmmssZ` pattern for `ee_TG`), which is read only after such a marker.
_EWE = frozenset({"ŋdiga", "\u0263etrɔga"})

# Every accepted shape; only reached when the fast path does not match. A 12-hour marker stands
# after the time or, after the space that follows the date, before it; mainland Chinese writes
# the UTC offset before such a marker as well as after the time (`+1000 上午7:57:00 +1000`).
# The markers' alternatives are tried only where a marker can start (not at a digit, a sign or
# the end): tried in vain before every time and offset, they cost 1.5 to 3.4 µs a timestamp.
_GENERAL = re.compile(
    r"(?P<year>[0-9]{4})-(?P<month>[0-9]{2})-(?P<day>[0-9]{2})"
    r"(?:(?:T| (?:(?![0-9])"
    r"(?:(?P<lead_sign>[+-])(?P<lead_hours>[0-9]{2}):?(?P<lead_minutes>[0-9]{2}) ?)?"
    rf"(?P<before>{_MARKER}){_SPACES}?)?)"
    r"(?P<hour>[0-9]{1,2}):(?P<minute>[0-9]{2})"
    r"(?::(?P<second>[0-9]{2})(?:\.(?P<fraction>[0-9]{1,9}))?)?"
    rf"(?:{_SPACES}?(?![+-]|Z?\Z)(?P<after>{_MARKER}))?"
    rf"(?P<le>{_SPACES}(?i:le))?"
    r" ?(?:Z|(?P<sign>[+-])(?P<offset_hours>[0-9]{2}):?(?P<offset_minutes>[0-9]{2}))?)?"
)


# The bidi marks of CLDR's plus and minus signs in the `arab` (ALM; RLM for Central Kurdish) and
# `arabext` (LRM) numbering systems, which ICU may set beside a number: dropped wherever they stand.
_BIDI_MARKS = dict.fromkeys(map(ord, "\u061c\u200e\u200f"))
_BIDI_MARK = re.compile("[\u061c\u200e\u200f]")
_ASCII_ZERO = ord("0")
_ASCII_DIGIT = re.compile("[0-9]")
_OTHER_DIGIT = re.compile(r"(?![0-9])\d")
# A UTC offset in ASCII digits at the end, as ICU writes `Z` whatever the locale's digits.
_ASCII_OFFSET = re.compile(r"[+-][0-9]{2}:?[0-9]{2}\Z")


class TimestampError(ValueError):
    """A timestamp could not be parsed or formatted; the message never quotes the input."""


def _days_from_civil(year: int, month: int, day: int) -> int:
    """Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's algorithm)."""
    if month <= 2:
        year -= 1
    era = year // 400
    year_of_era = year - era * 400
    day_of_year = (153 * (month + (9 if month <= 2 else -3)) + 2) // 5 + day - 1
    day_of_era = year_of_era * 365 + year_of_era // 4 - year_of_era // 100 + day_of_year
    return era * 146_097 + day_of_era - 719_468


def _civil_from_days(days: int) -> tuple[int, int, int]:
    """Inverse of `_days_from_civil`."""
    days += 719_468
    era = days // 146_097
    day_of_era = days - era * 146_097
    year_of_era = (
        day_of_era - day_of_era // 1460 + day_of_era // 36_524 - day_of_era // 146_096
    ) // 365
    day_of_year = day_of_era - (365 * year_of_era + year_of_era // 4 - year_of_era // 100)
    shifted_month = (5 * day_of_year + 2) // 153
    day = day_of_year - (153 * shifted_month + 2) // 5 + 1
    month = shifted_month + (3 if shifted_month < 10 else -9)
    year = year_of_era + era * 400 + (1 if month <= 2 else 0)
    return year, month, day


_MIN_US = _days_from_civil(1, 1, 1) * _US_PER_DAY
_MAX_US = _days_from_civil(10_000, 1, 1) * _US_PER_DAY - 1


def _instant(
    year: int,
    month: int,
    day: int,
    hour: int,
    minute: int,
    second: int,
    micro: int,
    offset_minutes: int,
) -> int:
    """Validate the fields of a local time and return its UTC instant in microseconds."""
    if year < 1:
        raise TimestampError("timestamp year is out of range 1..9999")
    if not 1 <= month <= 12:
        raise TimestampError("timestamp month is out of range 1..12")
    if month == 2 and year % 4 == 0 and (year % 100 != 0 or year % 400 == 0):
        month_length = 29
    else:
        month_length = _DAYS_IN_MONTH[month]
    if not 1 <= day <= month_length:
        raise TimestampError("timestamp day does not exist in its month")
    if hour > 23:
        raise TimestampError("timestamp hour is out of range 0..23")
    if minute > 59:
        raise TimestampError("timestamp minute is out of range 0..59")
    if second > 59:
        raise TimestampError("timestamp second is out of range 0..59 (leap seconds are rejected)")
    if abs(offset_minutes) > _MAX_OFFSET_MINUTES:
        raise TimestampError("timestamp UTC offset is beyond ±18:00")
    seconds = ((hour * 60 + minute - offset_minutes) * 60) + second
    us = (_days_from_civil(year, month, day) * 86_400 + seconds) * _US_PER_SECOND + micro
    if not _MIN_US <= us <= _MAX_US:
        raise TimestampError("timestamp instant falls outside years 1..9999 UTC")
    return us


def _offset_minutes(sign: str, hours: str, minutes: str) -> int:
    """Signed offset east of UTC in minutes; rejects a minutes field of 60 or more."""
    minute_count = int(minutes)
    if minute_count > 59:
        raise TimestampError("timestamp UTC offset minutes are out of range 0..59")
    total = int(hours) * 60 + minute_count
    return -total if sign == "-" else total


def latin_digits(value: str) -> str:
    """``value`` trimmed, without bidi marks and with the decimal digits of one script written in
    ASCII (rule 3).

    Every digit must be of one script, but for the UTC offset, which may be in ASCII: ICU writes
    a phone's date in its locale's digits (Arabic-Indic, Devanagari, ...) and the offset of `Z`
    always in ASCII. Unicode keeps each script's digits 0..9 in a run of ten code points.
    """
    if len(value) > _MAX_LENGTH:
        raise TimestampError(f"timestamp is longer than {_MAX_LENGTH} characters")
    text = value.strip()
    if _BIDI_MARK.search(text) is not None:
        text = text.translate(_BIDI_MARKS).strip()
    digit = _OTHER_DIGIT.search(text)
    if digit is None:
        return text
    latin = text.translate(_to_ascii(ord(digit[0]) - unicodedata.decimal(digit[0])))
    offset = _ASCII_OFFSET.search(text)
    head = len(text) if offset is None else offset.start()
    if _OTHER_DIGIT.search(latin) is not None or _ASCII_DIGIT.search(text, 0, head) is not None:
        raise TimestampError("timestamp mixes digits of different scripts")
    return latin


@functools.cache
def _to_ascii(zero: int) -> dict[int, int]:
    """The table that writes the digits of the script whose zero is ``zero`` in ASCII."""
    return {zero + digit: _ASCII_ZERO + digit for digit in range(10)}


def _parse_general(text: str) -> int:
    """Parse any accepted shape other than the fast path's; digits other than ASCII, which no
    shape matches, are read as ASCII."""
    match = _GENERAL.fullmatch(text)
    if match is None and not text.isascii():
        match = _GENERAL.fullmatch(latin_digits(text))
    if match is None:
        raise TimestampError("timestamp does not match a supported date/time shape")
    year, month, day = int(match["year"]), int(match["month"]), int(match["day"])
    if match["hour"] is None:
        return _instant(year, month, day, 0, 0, 0, 0, 0)
    hour = _hour(int(match["hour"]), match["before"], match["after"])
    if match["le"] is not None and (match["before"] is None or _key(match["before"]) not in _EWE):
        raise TimestampError("timestamp does not match a supported date/time shape")
    second = match["second"]
    fraction = match["fraction"]
    micro = 0 if fraction is None else int(fraction[:6].ljust(6, "0"))
    offset = 0
    if match["sign"] is not None:
        offset = _offset_minutes(match["sign"], match["offset_hours"], match["offset_minutes"])
    if match["lead_sign"] is not None and (
        match["sign"] is None
        or _offset_minutes(match["lead_sign"], match["lead_hours"], match["lead_minutes"]) != offset
    ):
        raise TimestampError("timestamp UTC offset before the time differs from the one after it")
    return _instant(
        year,
        month,
        day,
        hour,
        int(match["minute"]),
        0 if second is None else int(second),
        micro,
        offset,
    )


def _hour(hour: int, before: str | None, after: str | None) -> int:
    """The hour of the day of a time's hour and its 12-hour marker, if it has one."""
    if before is not None and after is not None:
        raise TimestampError("timestamp does not match a supported date/time shape")
    marker = after if before is None else before
    if marker is None:
        return hour
    # The pattern matches a marker in any letter case as Python's `re` folds it, which also
    # takes the dotless i (U+0131) and the dotted capital I (U+0130) for `i`; case folding keeps
    # the one and makes the other `i` and U+0307, so such a spelling names no marker of the table
    # and is refused (TIME-40).
    sides = _MARKERS.get(_key(marker))
    if sides is None:
        raise TimestampError("timestamp does not match a supported date/time shape")
    first, start, stop = sides
    if not first <= hour <= first + 11:
        raise TimestampError(f"timestamp 12-hour clock hour is out of range {first}..{first + 11}")
    hour %= 12
    if hour < start:
        hour += 12
    if not start <= hour < stop:
        raise TimestampError("timestamp 12-hour clock hour lies outside its day period")
    return hour


def _key(marker: str) -> str:
    """The row of ``_MARKERS`` a marker as matched names, if any: its letters case-folded and
    any space inside it dropped."""
    return marker.translate(_NO_SPACES).casefold()


def parse_instant(value: object) -> int:
    """UTC instant in integer microseconds since the Unix epoch."""
    if not isinstance(value, str):
        raise TimestampError(f"timestamp must be a str, not {type(value).__name__}")
    match = _COMMON.fullmatch(value)
    if match is not None:
        year, month, day, hour, minute, second, sign, off_h, off_m = match.groups()
        return _instant(
            int(year),
            int(month),
            int(day),
            int(hour),
            int(minute),
            int(second),
            0,
            _offset_minutes(sign, off_h, off_m),
        )
    if len(value) > _MAX_LENGTH:
        raise TimestampError(f"timestamp is longer than {_MAX_LENGTH} characters")
    text = value.strip()
    if not text:
        raise TimestampError("timestamp is empty")
    return _parse_general(text)


def format_instant(us: int) -> str:
    """ISO 8601 UTC with 'Z'; a non-zero fraction gets up to 6 digits, trailing zeros removed.

    e.g. 0 -> '1970-01-01T00:00:00Z', 1_500_000 -> '1970-01-01T00:00:01.5Z'.
    """
    if not _MIN_US <= us <= _MAX_US:
        raise TimestampError("instant falls outside years 1..9999 UTC")
    days, us_of_day = divmod(us, _US_PER_DAY)
    year, month, day = _civil_from_days(days)
    seconds_of_day, micro = divmod(us_of_day, _US_PER_SECOND)
    hour, seconds_of_hour = divmod(seconds_of_day, 3600)
    minute, second = divmod(seconds_of_hour, 60)
    fraction = f".{micro:06d}".rstrip("0") if micro else ""
    return f"{year:04d}-{month:02d}-{day:02d}T{hour:02d}:{minute:02d}:{second:02d}{fraction}Z"


def hour_of(us: int) -> int:
    """Start of the UTC hour containing us, in microseconds (floor, also for negative values)."""
    return us - us % US_PER_HOUR
