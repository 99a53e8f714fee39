"""Pydantic models the structured-output tests ask for (nested objects, enums, arrays, literals,
required and optional fields), sized so the embedded model finishes them well inside
``MAX_TOKENS``: strings and arrays bounded, integers in ranges."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, Field

MAX_TOKENS = 160
Word = Annotated[str, Field(max_length=10)]
Small = Annotated[int, Field(ge=0, le=100)]


class Color(StrEnum):
    red = "red"
    green = "green"
    blue = "blue"


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)


class Flag(BaseModel):
    ok: bool


class Paint(BaseModel):
    color: Color
    coats: int = Field(ge=1, le=3)


class Point(BaseModel):
    x: int = Field(ge=-50, le=50)
    y: int = Field(ge=-50, le=50)


class Segment(BaseModel):
    start: Point
    end: Point


class Tags(BaseModel):
    tags: list[Word] = Field(max_length=3)


class Scores(BaseModel):
    scores: list[Small] = Field(min_length=1, max_length=4)


class MaybeNick(BaseModel):
    name: str = Field(max_length=10)
    nickname: str | None = Field(default=None, max_length=10)


class Address(BaseModel):
    city: str = Field(max_length=15)
    zip: str = Field(pattern=r"^[0-9]{5}$")


class Customer(BaseModel):
    id: int = Field(ge=1, le=9999)
    address: Address


class Mood(BaseModel):
    mood: Literal["happy", "sad", "calm"]


class Item(BaseModel):
    sku: str = Field(max_length=8)
    qty: int = Field(ge=1, le=9)


class Order(BaseModel):
    items: list[Item] = Field(min_length=1, max_length=2)
    express: bool


class Temperature(BaseModel):
    celsius: float = Field(ge=-40, le=60)


class Book(BaseModel):
    title: str = Field(max_length=20)
    year: int = Field(ge=1800, le=2030)
    genre: Literal["fiction", "science", "history"]


class Pets(BaseModel):
    cats: int = Field(ge=0, le=5)
    dogs: int = Field(ge=0, le=5)
    names: list[Word] = Field(max_length=2)


class Weekday(StrEnum):
    mon = "monday"
    tue = "tuesday"
    wed = "wednesday"


class Meeting(BaseModel):
    day: Weekday
    hour: int = Field(ge=0, le=23)
    remote: bool | None = None


class Rgb(BaseModel):
    r: int = Field(ge=0, le=255)
    g: int = Field(ge=0, le=255)
    b: int = Field(ge=0, le=255)


class Team(BaseModel):
    lead: Person
    size: int = Field(ge=1, le=20)


class Answer(BaseModel):
    answer: Literal["yes", "no"]
    confidence: int = Field(ge=0, le=100)


class Grid(BaseModel):
    rows: list[Annotated[list[Small], Field(max_length=3)]] = Field(max_length=2)


class Palette(BaseModel):
    colors: list[Color] = Field(min_length=1, max_length=3)
    name: str | None = Field(default=None, max_length=10)


SCHEMAS: list[tuple[type[BaseModel], str]] = [
    (Person, "Describe a person."),
    (Flag, "Is the sky blue?"),
    (Paint, "How should I paint the wall?"),
    (Point, "Give a point."),
    (Segment, "Give a line segment."),
    (Tags, "Tag this post about cooking pasta."),
    (Scores, "List some test scores."),
    (MaybeNick, "Name a friend."),
    (Customer, "Invent a customer."),
    (Mood, "How do you feel?"),
    (Order, "Place an order."),
    (Temperature, "What is the temperature in Paris?"),
    (Book, "Recommend a book."),
    (Pets, "Describe my pets."),
    (Meeting, "Schedule a meeting."),
    (Rgb, "Give the color orange as RGB."),
    (Team, "Describe a team."),
    (Answer, "Is water wet?"),
    (Grid, "Give a small grid of numbers."),
    (Palette, "Make a color palette."),
    (Address, "Give an address."),
]
